"""Prefill and batched-decode tokens/s of the JAX target next to transformers (PyTorch eager, CPU).

  python benchmarks/target_throughput.py [--batch=8] [--prompt_len=128] [--new_tokens=64] [--repeats=3]

Both run SmolLM2-135M-Instruct loaded from the same GGUF in float32, on the same token
prompts, in this one process. Prefill = one forward over `batch x prompt_len` tokens.
Decode = `new_tokens` greedy steps with a KV cache for the whole batch (EOS ignored),
timed as (prefill + decode) minus prefill. Needs the test extras (torch, transformers).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from dspark_jax import sharding
from dspark_jax.target import load_target
from dspark_jax.target.checkpoint import default_target_path
from dspark_jax.target.generate import Generator


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up (compilation for JAX, allocator for torch)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return min(times)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    b, p, n = args.batch, args.prompt_len, args.new_tokens

    path = default_target_path()
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    target = load_target(path, mesh=mesh)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
    vocab = target.config.vocab_size
    ids = np.random.RandomState(0).randint(100, vocab, (b, p)).astype(np.int32)
    ids_pt = torch.tensor(ids, dtype=torch.long)

    model = target.model
    jax_prefill = jax.jit(lambda x: model.logits(model(x).hidden_BxTxH[:, -1]))
    ids_jax = jnp.asarray(ids)
    t_jax_prefill = best_of(lambda: jax_prefill(ids_jax).block_until_ready(), args.repeats)

    def torch_prefill():
        with torch.no_grad():
            hf(ids_pt, logits_to_keep=1)

    t_pt_prefill = best_of(torch_prefill, args.repeats)

    never = [vocab]  # an id no row can produce: every row decodes all `n` tokens
    generator = Generator(model, eos_ids=never, pad_id=0, batch_size=b, mesh=mesh)
    prompts = ids.tolist()
    t_jax_total = best_of(lambda: generator.generate(prompts, max_new_tokens=n), args.repeats)

    def torch_generate():
        with torch.no_grad():
            hf.generate(
                ids_pt,
                attention_mask=torch.ones_like(ids_pt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    t_pt_total = best_of(torch_generate, args.repeats)
    # The JAX program pads prompts to a power-of-two bucket: its prefill is the same size here.
    t_jax_decode = t_jax_total - t_jax_prefill
    t_pt_decode = t_pt_total - t_pt_prefill

    rows = [
        ("prefill tokens/s", b * p / t_jax_prefill, b * p / t_pt_prefill),
        (f"decode tokens/s (batch {b})", b * n / t_jax_decode, b * n / t_pt_decode),
    ]
    print(
        f"SmolLM2-135M-Instruct float32, CPU x{torch.get_num_threads()} threads, batch={b}, prompt={p}, "
        f"new={n}, best of {args.repeats}; jax {jax.__version__}, torch {torch.__version__}"
    )
    print(f"{'metric':32s} {'jax':>12s} {'torch':>12s} {'jax/torch':>10s}")
    for name, j, t in rows:
        print(f"{name:32s} {j:12.1f} {t:12.1f} {j / t:10.2f}")


if __name__ == "__main__":
    main()
