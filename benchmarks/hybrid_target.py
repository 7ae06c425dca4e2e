"""What a hybrid MoE target costs the speculative verifier, next to a dense target of the same size.

  python benchmarks/hybrid_target.py [--rows=4] [--context=256] [--repeats=5] [--quick]

One table, each row the median of `--repeats` jitted calls after a warm-up:
  verify   the verify cycle's target work for `rows x 8` tokens appended to a cache of `--context` tokens:
           a dense target (every layer full attention + SwiGLU) against a hybrid one of the same widths
           (linear + full attention, sparse MLPs), the hybrid with the per-token state selection
           (`keep_steps` + `keep_prefix`) and without (a plain append, which could not roll back).
(The sparse MLP alone against its all-experts reference: `benchmarks/moe_forward.py`.)
Random weights; shapes only matter. Runs on whatever device JAX finds (the CPU here).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax.target.config import TargetConfig
from dspark_jax.target.model import DecodeCache, Transformer, keep_prefix

DENSE = TargetConfig(
    family="qwen3",
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    qk_norm=True,
    max_position_embeddings=4096,
)
HYBRID = dataclasses.replace(
    DENSE,
    family="qwen3_next",
    layer_types=("linear_attention",) * 3
    + ("full_attention",)
    + ("linear_attention",) * 3
    + ("full_attention",),
    attn_output_gate=True,
    partial_rotary_factor=0.25,
    norm_unit_offset=True,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
)


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def verify_seconds(cfg: TargetConfig, rows: int, context: int, repeats: int, select: bool) -> float:
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    cache = DecodeCache.zeros(cfg, rows, context + 16, jnp.float32)
    cache = model(jnp.ones((rows, context), jnp.int32), cache=cache).cache
    tokens = jnp.ones((rows, 8), jnp.int32)
    keep_B = jnp.arange(rows, dtype=jnp.int32) % 9

    @jax.jit
    def cycle(tokens, cache):
        out = model(tokens, cache=cache, keep_steps=select)
        logits = model.logits(out.hidden_BxTxH)
        if select:
            return logits, keep_prefix(cache, out.cache, out.steps, cache.end_B + keep_B)
        return logits, out.cache._replace(end_B=cache.end_B + keep_B)

    return median_seconds(lambda: cycle(tokens, cache), repeats)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small context and token counts, a few seconds")
    args = parser.parse_args()
    context = 32 if args.quick else args.context
    print(f"device: {jax.devices()[0].platform}; verify: {args.rows} rows x 8 tokens after {context}")
    dense = verify_seconds(DENSE, args.rows, context, args.repeats, select=False)
    plain = verify_seconds(HYBRID, args.rows, context, args.repeats, select=False)
    selected = verify_seconds(HYBRID, args.rows, context, args.repeats, select=True)
    print(f"{'verify cycle':<40} {'ms':>9} {'x dense':>8}")
    for name, seconds in (
        ("dense target", dense),
        ("hybrid MoE target, plain append", plain),
        ("hybrid MoE target, state selection", selected),
    ):
        print(f"{name:<40} {seconds * 1e3:9.2f} {seconds / dense:8.2f}")


if __name__ == "__main__":
    main()
