"""The sparse MoE forward's implementations next to the dense all-experts reference, in one run.

  python benchmarks/moe_forward.py [--tokens=64,512] [--experts=64] [--top_k=8] [--hidden=256] \
      [--intermediate=128] [--dtype=float32] [--repeats=7] [--implementations=tiled,ragged_dot] [--quick]
  python benchmarks/moe_forward.py --shape=qwen3-30b-a3b --tokens=256,2048 --dtype=bfloat16   # a GPU/TPU

One random `SparseMoE` (no shared expert) per implementation (`kernels.experts`), each forward jitted over
the same `[1, tokens, H]` inputs, one warm-up call (compilation), then the median of `--repeats` calls.
`dense/x` above 1 means implementation x is faster than the all-experts reference, which does `X` rows of
expert work per token against the routed `K`. Memory is each compiled program's temporary bytes (XLA's
memory analysis). 'auto' is what the block runs by default on this backend (printed in the header):
'tiled' on CPU and GPU, 'ragged_dot' on TPU, where it compiles to a grouped matmul; elsewhere `ragged_dot`
is rewritten as a masked dense dot over all `X` groups for each of the `tokens * K` rows (`K` times the dense
work, an `[X, tokens*K, H]` mask). `--shape=qwen3-30b-a3b` sets a Qwen3-30B-A3B layer (128 experts, top 8,
H 2048, I 768). `--quick` (8 and 64 tokens, 3 repeats, tiled only) runs in seconds on CPU (a test runs it).
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

from dspark_jax.kernels.experts import resolve_implementation
from dspark_jax.target.moe import SparseMoE, dense_reference

SHAPES = {"qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, intermediate=768)}


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
    parser.add_argument("--tokens", default="64,512")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top_k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a named layer shape (sets the four above)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--implementations", default="tiled,ragged_dot", help="besides the dense reference")
    parser.add_argument("--quick", action="store_true", help="8 and 64 tokens, 3 repeats, tiled only")
    args = parser.parse_args()
    if args.shape:
        vars(args).update(SHAPES[args.shape])
    tokens = [8, 64] if args.quick else [int(t) for t in args.tokens.split(",")]
    repeats = 3 if args.quick else args.repeats
    implementations = ["tiled"] if args.quick else args.implementations.split(",")
    for name in implementations:
        resolve_implementation(name)  # an unknown name fails before any compile
    dtype = jnp.dtype(args.dtype)

    def block(implementation):
        moe = SparseMoE(
            args.hidden,
            args.experts,
            args.top_k,
            args.intermediate,
            norm_topk_prob=True,
            rngs=nnx.Rngs(0),
            param_dtype=dtype,
            dtype=dtype,
            implementation=implementation,
        )
        return nnx.split(moe)

    forwards = {}
    for name in implementations:
        graphdef, state = block(name)
        forwards[name] = (lambda state, x, g=graphdef: nnx.merge(g, state)(x), state)
    graphdef, state = block("dense")
    forwards["dense"] = (lambda state, x: dense_reference(nnx.merge(graphdef, state), x), state)

    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, {args.dtype}; "
        f"X={args.experts} K={args.top_k} H={args.hidden} I={args.intermediate}; median of {repeats}; "
        f"'auto' here is {resolve_implementation('auto')}"
    )
    print(f"{'tokens':>7s} {'implementation':>15s} {'ms':>9s} {'dense/x':>8s} {'temp MB':>9s}")
    for t in tokens:
        x_BxTxH = jax.random.normal(jax.random.key(t), (1, t, args.hidden), dtype)
        measured = {name: measure(fn, state, x_BxTxH, repeats) for name, (fn, state) in forwards.items()}
        for name, (seconds, temp) in measured.items():
            print(
                f"{t:7d} {name:>15s} {1e3 * seconds:9.2f} {measured['dense'][0] / seconds:7.2f}x "
                f"{temp / 1e6:9.1f}"
            )


if __name__ == "__main__":
    main()
