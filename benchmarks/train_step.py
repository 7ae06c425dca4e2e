"""Training step time and tokens/s of the demo and smoke presets, and blocked vs dense block attention.

  python benchmarks/train_step.py [--steps=5] [--presets=smoke,demo]

Step timing uses synthetic batches with each preset's exact shapes (values do not change
the work), so no cache is needed. The attention comparison runs forward + backward of the
chunked XLA block attention and of the dense masked reference at a mid-size shape and
prints time, XLA temp memory and their ratios.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import baseline
from dspark_jax import sharding
from dspark_jax.data import anchors as anchors_lib
from dspark_jax.data.pipeline import to_global
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.kernels.block_attention import block_attention
from dspark_jax.target import TargetConfig
from dspark_jax.target.checkpoint import default_target_path, load_checkpoint
from dspark_jax.train import experiment
from dspark_jax.train import step as step_lib


def synthetic_batch(config, target: TargetConfig, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch with the preset's shapes: response tokens from 1/4 of the sequence on."""
    rng = np.random.default_rng(seed)
    t, n = config.data.max_length, config.train.num_anchors
    ids = rng.integers(0, target.vocab_size, (rows, t)).astype(np.int32)
    mask = np.zeros((rows, t), np.uint8)
    mask[:, t // 4 :] = 1
    anchors, keep = map(np.stack, zip(*(anchors_lib.sample_anchors(m, n, rng) for m in mask)))
    a, h = len(config.data.aux_layer_ids), target.hidden_size
    return {
        "input_ids": ids,
        "aux_hidden": rng.normal(size=(rows, t, a, h)).astype(jnp.bfloat16),
        "last_hidden": rng.normal(size=(rows, t, h)).astype(jnp.bfloat16),
        "anchors": anchors,
        "labels": anchors_lib.block_labels(ids, anchors),
        "predecessors": anchors_lib.markov_predecessors(ids, anchors),
        "eval_mask": anchors_lib.eval_mask(mask, anchors, keep),
    }


def preset_target(config) -> TargetConfig:
    if config.target.random_init:
        return TargetConfig.from_json(config.target.arch.to_dict())
    return load_checkpoint(default_target_path()).config


def time_step(preset: str, steps: int) -> dict[str, float]:
    config = baseline.get_config(preset)
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = preset_target(config)
    graphdef, params, rest = experiment.init_draft(config, target, mesh)
    _, optimizer = experiment.make_training_optimizer(config)
    opt_state = jax.jit(optimizer.init)(params)
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.random.split(jax.random.key(0))
    frozen = jax.device_put(
        FrozenTarget(
            0.02 * jax.random.normal(key[0], (target.vocab_size, target.hidden_size)),
            0.02 * jax.random.normal(key[1], (target.hidden_size, target.vocab_size)),
        ),
        replicated,
    )
    micro_rows = config.train.global_batch // config.train.grad_accum
    batch = to_global(synthetic_batch(config, target, micro_rows), mesh)
    weight = step_lib.global_weight([np.asarray(batch["eval_mask"])])
    micro = jax.jit(functools.partial(step_lib.micro_step, graphdef=graphdef))
    update = jax.jit(functools.partial(step_lib.apply_step, optimizer=optimizer), donate_argnums=(0, 1))

    def one_step(params, opt_state):
        grads, _ = micro(params, rest, frozen, batch, weight)
        for _ in range(config.train.grad_accum - 1):
            grads = jax.tree.map(jnp.add, grads, micro(params, rest, frozen, batch, weight)[0])
        params, opt_state, norm = update(params, opt_state, grads)
        jax.block_until_ready(norm)
        return params, opt_state

    params, opt_state = one_step(params, opt_state)  # compile
    begin = time.perf_counter()
    for _ in range(steps):
        params, opt_state = one_step(params, opt_state)
    seconds = (time.perf_counter() - begin) / steps
    tokens = config.train.global_batch * config.data.max_length
    return {
        "step_seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "samples_per_second": config.train.global_batch / seconds,
    }


def attention_comparison(b=1, n=128, s=7, t=1024, h=8, kv=2, d=64, repeats=3) -> dict[str, dict[str, float]]:
    keys = jax.random.split(jax.random.key(0), 5)
    args = [
        jax.random.normal(keys[0], (b, n, s, h, d)),
        jax.random.normal(keys[1], (b, t, kv, d)),
        jax.random.normal(keys[2], (b, t, kv, d)),
        jax.random.normal(keys[3], (b, n, s, kv, d)),
        jax.random.normal(keys[4], (b, n, s, kv, d)),
        jnp.sort(jax.random.randint(keys[0], (b, n), 0, t), 1),
    ]
    results = {}
    for impl in ("xla", "reference"):
        fn = jax.jit(
            jax.grad(
                lambda *a, impl=impl: jnp.sum(block_attention(*a, implementation=impl) ** 2),
                argnums=(0, 1, 2, 3, 4),
            )
        )
        compiled = fn.lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        begin = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(compiled(*args))
        results[impl] = {
            "seconds": (time.perf_counter() - begin) / repeats,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        }
    return results


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--presets", default="smoke,demo")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}")
    print(f"{'preset':8s} {'step s':>10s} {'tokens/s':>12s} {'samples/s':>10s}")
    for preset in args.presets.split(","):
        r = time_step(preset, args.steps)
        step_s, tok_s, smp_s = r["step_seconds"], r["tokens_per_second"], r["samples_per_second"]
        print(f"{preset:8s} {step_s:10.3f} {tok_s:12.0f} {smp_s:10.2f}")
    att = attention_comparison()
    x, ref = att["xla"], att["reference"]
    print("block attention fwd+bwd, B=1 N=128 S=7 T=1024 H=8 KV=2 D=64:")
    print(f"{'impl':10s} {'seconds':>10s} {'temp MB':>10s}")
    for impl, r in att.items():
        print(f"{impl:10s} {r['seconds']:10.4f} {r['temp_bytes'] / 1e6:10.1f}")
    time_ratio, memory_ratio = x["seconds"] / ref["seconds"], x["temp_bytes"] / ref["temp_bytes"]
    print(f"xla/dense: time {time_ratio:.2f}x, temp memory {memory_ratio:.2f}x")


if __name__ == "__main__":
    main()
