"""The sparse MoE forward (sort by expert + `ragged_dot`) next to the dense all-experts reference.

  python benchmarks/moe_forward.py [--tokens=8,64,512] [--experts=64] [--top_k=8] [--hidden=256] \
      [--intermediate=128] [--dtype=float32] [--repeats=7] [--quick]

One random `SparseMoE` (no shared expert), both forwards jitted over the same `[1, tokens, H]` inputs,
one warm-up call each (compilation), then the median of `--repeats` calls. `dense/sparse` above 1 means
the sparse pass is faster. Memory is the compiled program's temporary bytes (XLA's memory analysis).
The sparse pass does `K` rows of expert work per token, the dense one `X`; but on CPU, JAX lowers
`ragged_dot` to a masked dense dot over all `X` groups for each of the `tokens * K` rows, so there the
sparse pass does `K` times the dense work and holds a `[X, tokens*K, H]` mask: expect it to lose on CPU
and to win where `ragged_dot` is a grouped matmul (TPU). On an H200 with JAX 0.11.2 it is the masked
dense rewrite too (`results/gpu-targets-2026-12-04`: the sparse temporaries are `X * tokens*K * H` x 2
bytes). `--quick` (8 and 64 tokens, 3 repeats) runs in a few seconds on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax.target.moe import SparseMoE, dense_reference


def measure(forward, state, x_BxTxH, repeats: int) -> tuple[float, int]:
    """Median seconds per call of the jitted `forward(state, x)` and its compiled temporary bytes."""
    compiled = jax.jit(forward).lower(state, x_BxTxH).compile()
    jax.block_until_ready(compiled(state, x_BxTxH))
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(compiled(state, x_BxTxH))
        times.append(time.perf_counter() - begin)
    return statistics.median(times), compiled.memory_analysis().temp_size_in_bytes


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="8,64,512")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top_k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="8 and 64 tokens, 3 repeats")
    args = parser.parse_args()
    tokens = [8, 64] if args.quick else [int(t) for t in args.tokens.split(",")]
    repeats = 3 if args.quick else args.repeats
    dtype = jnp.dtype(args.dtype)

    moe = SparseMoE(
        args.hidden,
        args.experts,
        args.top_k,
        args.intermediate,
        norm_topk_prob=True,
        rngs=nnx.Rngs(0),
        param_dtype=dtype,
        dtype=dtype,
    )
    graphdef, state = nnx.split(moe)
    sparse = lambda state, x: nnx.merge(graphdef, state)(x)
    dense = lambda state, x: dense_reference(nnx.merge(graphdef, state), x)

    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, {args.dtype}; "
        f"X={args.experts} K={args.top_k} H={args.hidden} I={args.intermediate}; median of {repeats}"
    )
    print(
        f"{'tokens':>7s} {'sparse ms':>10s} {'dense ms':>10s} {'dense/sparse':>13s} "
        f"{'sparse temp MB':>15s} {'dense temp MB':>14s}"
    )
    for t in tokens:
        x_BxTxH = jax.random.normal(jax.random.key(t), (1, t, args.hidden), dtype)
        t_sparse, m_sparse = measure(sparse, state, x_BxTxH, repeats)
        t_dense, m_dense = measure(dense, state, x_BxTxH, repeats)
        print(
            f"{t:7d} {1e3 * t_sparse:10.2f} {1e3 * t_dense:10.2f} {t_dense / t_sparse:12.2f}x "
            f"{m_sparse / 1e6:15.1f} {m_dense / 1e6:14.1f}"
        )


if __name__ == "__main__":
    main()
