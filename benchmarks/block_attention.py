"""Block attention: Pallas vs chunked XLA vs dense reference, time and memory, at demo and paper shapes.

  python benchmarks/block_attention.py [--shapes=demo,paper] [--passes=fwd,fwd+bwd] [--repeats=3] \
      [--implementations=pallas,xla,reference,tokamax:mosaic]

Shapes (the legend's letters): demo B=1 N=64 S=7 T=1024 Q=8 G=2 D=64; paper B=1 N=512 S=7 T=4096 Q=24
G=2 D=256; random sorted anchors over the row. The Pallas row is the backend's compiled kernel (TPU:
Mosaic; GPU: the Mosaic GPU kernel, bf16 only); on a backend without one (CPU) it runs the TPU kernel
in interpret mode, which measures the interpreter, not the kernel: it is there to show the path runs
at that shape. Memory is the compiled program's temporary bytes (XLA's
memory analysis), the peak working set beyond inputs and outputs. The Pallas kernel's backward is the
chunked XLA path (custom VJP), so its `fwd+bwd` row adds one Pallas forward to the XLA row's cost.

`tokamax:IMPL` rows (when tokamax is installed) run tokamax's `dot_product_attention` with IMPL
('mosaic', 'triton', 'cudnn', 'xla', 'xla_chunked'; bare `tokamax` = its own choice) over the keys
`[context; every block's slots]` with the dense block-visibility mask: its public API takes a boolean mask,
not per-query key ranges, so it cannot skip the context past a block's anchor. A row that fails prints
its error and the others go on. `max |d|` is the forward's largest difference from the XLA row.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax.kernels.block_attention import PALLAS_BACKENDS, block_attention

SHAPES = {
    "demo": dict(b=1, n=64, s=7, t=1024, q=8, g=2, d=64),
    "paper": dict(b=1, n=512, s=7, t=4096, q=24, g=2, d=256),
}


def _inputs(b, n, s, t, q, g, d, dtype):
    keys = jax.random.split(jax.random.key(0), 6)
    return [
        jax.random.normal(keys[0], (b, n, s, q, d), dtype),
        jax.random.normal(keys[1], (b, t, g, d), dtype),
        jax.random.normal(keys[2], (b, t, g, d), dtype),
        jax.random.normal(keys[3], (b, n, s, g, d), dtype),
        jax.random.normal(keys[4], (b, n, s, g, d), dtype),
        jnp.sort(jax.random.randint(keys[5], (b, n), 0, t), 1),
    ]


def tokamax_attention(implementation: str | None):
    """Block attention through tokamax (`implementation` None = tokamax's choice): one attention over
    `[context; all blocks' slots]` under the dense visibility mask `[B, 1, N*S, T + N*S]`."""
    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; this script's own come from argparse
        flags.FLAGS.mark_as_parsed()

    def attend(q_BxNxSxQxD, k_ctx_BxTxGxD, v_ctx_BxTxGxD, k_blk_BxNxSxGxD, v_blk_BxNxSxGxD, anchors_BxN):
        b, n, s, heads, d = q_BxNxSxQxD.shape
        t, g = k_ctx_BxTxGxD.shape[1:3]
        k_BxKxGxD = jnp.concatenate([k_ctx_BxTxGxD, k_blk_BxNxSxGxD.reshape(b, n * s, g, d)], axis=1)
        v_BxKxGxD = jnp.concatenate([v_ctx_BxTxGxD, v_blk_BxNxSxGxD.reshape(b, n * s, g, d)], axis=1)
        j_K = jnp.arange(t + n * s)
        block_NS = jnp.repeat(jnp.arange(n), s)
        context_BxNSxK = (j_K < jnp.repeat(anchors_BxN, s, axis=1)[..., None]) & (j_K < t)
        own_NSxK = (j_K >= t) & ((j_K - t) // s == block_NS[:, None])
        out = tokamax.dot_product_attention(
            q_BxNxSxQxD.reshape(b, n * s, heads, d),
            k_BxKxGxD,
            v_BxKxGxD,
            mask=(context_BxNSxK | own_NSxK)[:, None],
            implementation=implementation,
        )
        return out.reshape(q_BxNxSxQxD.shape)

    return attend


def measure(shape: dict, implementation: str, backward: bool, repeats: int, dtype) -> dict:
    """Seconds per call and temporary bytes of the compiled forward (or forward + backward), and the
    forward's output."""
    if implementation.startswith("tokamax"):
        attend = tokamax_attention(implementation.partition(":")[2] or None)
    else:
        interpret = implementation == "pallas" and jax.default_backend() not in PALLAS_BACKENDS
        attend = lambda *a: block_attention(*a, implementation=implementation, interpret=interpret)
    if backward:
        fn = jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4))
    else:
        fn = attend
    args = _inputs(**shape, dtype=dtype)
    compiled = jax.jit(fn).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    begin = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(compiled(*args))
    return {
        "seconds": (time.perf_counter() - begin) / repeats,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "output": None if backward else out,
    }


def _max_diff(a, b) -> float:
    """Largest absolute difference of two forward outputs (NaN when either is missing)."""
    if a is None or b is None:
        return float("nan")
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="demo,paper")
    parser.add_argument("--passes", default="fwd,fwd+bwd")
    parser.add_argument("--implementations", default="pallas,xla,reference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    backend = jax.default_backend()
    mode = "compiled" if backend in PALLAS_BACKENDS else "interpret"
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, {args.dtype}")
    print(
        f"{'shape':6s} {'pass':8s} {'implementation':20s} {'ms':>10s} {'temp MB':>9s} {'vs xla':>7s} "
        f"{'max |d|':>8s}"
    )
    for name in args.shapes.split(","):
        for pass_name in args.passes.split(","):
            rows = {}
            for impl in args.implementations.split(","):
                try:
                    rows[impl] = measure(
                        SHAPES[name], impl, pass_name == "fwd+bwd", args.repeats, jnp.dtype(args.dtype)
                    )
                except Exception as e:  # one row's failure (a missing library, a kernel limit) ends no others
                    rows[impl] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"}
            xla = rows.get("xla", {})
            for impl, r in rows.items():
                label = f"pallas ({mode})" if impl == "pallas" else impl
                if "error" in r:
                    print(f"{name:6s} {pass_name:8s} {label:20s} failed: {r['error']}")
                    continue
                ratio = r["seconds"] / xla["seconds"] if "seconds" in xla else float("nan")
                diff = _max_diff(r["output"], xla.get("output"))
                print(
                    f"{name:6s} {pass_name:8s} {label:20s} {1e3 * r['seconds']:10.1f} "
                    f"{r['temp_bytes'] / 1e6:9.1f} {ratio:6.2f}x {diff:8.1e}"
                )


if __name__ == "__main__":
    main()
