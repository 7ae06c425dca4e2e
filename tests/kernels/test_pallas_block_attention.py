"""The Pallas block attention kernel (interpret mode on CPU) against the dense reference; the dispatcher."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import sharding
from dspark_jax.kernels import block_attention as ba
from dspark_jax.kernels.block_attention import BlockMemory, BlockSizes, block_attention

T, N, S, D = 40, 6, 7, 8
SIZES = BlockSizes(block_q=2, block_k=8)  # 3 query tiles of 2 blocks, 5 context tiles
# Row 0 of each case (row 1 is a random sorted layout): anchors, then sample starts (packed rows).
LAYOUTS = {
    "first_anchor_at_0": ([0, 3, 9, 17, 30, 39], [0] * N),
    "anchors_at_the_end": ([36, 38, 39, 40, 40, 40], [0] * N),
    "repeated_anchors": ([5, 5, 5, 12, 12, 12], [0] * N),
    "padded_blocks": ([3, 10, 0, 0, 0, 0], [0] * N),  # ANCHOR_PAD = 0 after the real anchors
    "tiles_without_context": ([0, 0, 0, 0, 20, 25], [0] * N),
    "packed_samples": ([3, 6, 9, 14, 20, 30], [0, 0, 0, 10, 10, 10]),
}
GQA = {1: (2, 2), 4: (4, 1), 12: (12, 1)}  # ratio: (query heads, KV heads)


def _inputs(layout, ratio, memory_slots, dtype=jnp.float32, seed=0, d=D, t=T):
    heads, kv_heads = GQA[ratio]
    keys = jax.random.split(jax.random.key(seed), 9)
    normal = lambda k, shape: jax.random.normal(k, shape).astype(dtype)
    anchors, starts = LAYOUTS[layout]
    random_row = jnp.sort(jax.random.randint(keys[5], (N,), 0, t + 1))
    anchors = jnp.stack([jnp.asarray(anchors), random_row]).astype(jnp.int32)
    starts = jnp.stack([jnp.asarray(starts), jnp.zeros(N, jnp.int32)]).astype(jnp.int32)
    memory = None
    if memory_slots:
        valid = jax.random.bernoulli(keys[8], 0.6, (2, N, memory_slots))
        memory = BlockMemory(
            normal(keys[6], (2, N, memory_slots, kv_heads, d)),
            normal(keys[7], (2, N, memory_slots, kv_heads, d)),
            valid,
        )
    args = (
        normal(keys[0], (2, N, S, heads, d)),
        normal(keys[1], (2, t, kv_heads, d)),
        normal(keys[2], (2, t, kv_heads, d)),
        normal(keys[3], (2, N, S, kv_heads, d)),
        normal(keys[4], (2, N, S, kv_heads, d)),
        anchors,
    )
    return args, memory, starts


def _run(args, memory, starts, implementation, **kw):
    return block_attention(*args, memory, starts, implementation=implementation, **kw)


@pytest.mark.parametrize("memory_slots", [0, 3])
@pytest.mark.parametrize("ratio", sorted(GQA))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forward_equals_the_dense_reference_fp32(layout, ratio, memory_slots):
    args, memory, starts = _inputs(layout, ratio, memory_slots)
    want = _run(args, memory, starts, "reference")
    got = _run(args, memory, starts, "pallas", interpret=True, block_sizes=SIZES)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("ratio", sorted(GQA))
def test_forward_bf16_within_bf16_tolerance(ratio):
    """bf16 inputs (fp32 statistics inside): within bf16 rounding of the fp32 reference on the same inputs."""
    args, memory, starts = _inputs("packed_samples", ratio, 3, dtype=jnp.bfloat16)
    up = lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
    want = _run(jax.tree.map(up, args), jax.tree.map(up, memory), starts, "reference")
    got = _run(args, memory, starts, "pallas", interpret=True, block_sizes=SIZES)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    ("layout", "ratio", "memory_slots"), [("packed_samples", 4, 3), ("padded_blocks", 12, 0)]
)
def test_gradients_equal_the_dense_reference(layout, ratio, memory_slots):
    args, memory, starts = _inputs(layout, ratio, memory_slots, seed=1)
    cot = jax.random.normal(jax.random.key(7), args[0].shape)

    def loss(implementation, q, k_ctx, v_ctx, k_blk, v_blk, mem_kv, **kw):
        mem = None if mem_kv is None else BlockMemory(*mem_kv, memory.valid_BxNxM)
        out = block_attention(
            q, k_ctx, v_ctx, k_blk, v_blk, args[5], mem, starts, implementation=implementation, **kw
        )
        return jnp.sum(out * cot)

    mem_kv = None if memory is None else (memory.k_BxNxMxGxD, memory.v_BxNxMxGxD)
    inputs = (*args[:5], mem_kv)
    grads = lambda *a, **kw: jax.grad(lambda *x: loss(*a, *x, **kw), argnums=tuple(range(6)))(*inputs)
    want = grads("reference")
    got = grads("pallas", interpret=True, block_sizes=SIZES)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5, rtol=5e-5)


def test_the_kernel_runs_per_shard_under_a_multi_device_mesh(mesh8):
    """XLA cannot partition a Mosaic kernel: under a multi-device activation sharding `sharding.per_shard`
    runs it on each device's batch rows (heads gathered over 'tensor'), with one device's numbers."""
    parts = [_inputs("packed_samples", 4, 3, seed=i) for i in range(2)]
    args, memory, starts = jax.tree.map(lambda *x: jnp.concatenate(x), *parts)  # B = 4 = data 2 x fsdp 2
    attend = functools.partial(block_attention, implementation="pallas", interpret=True, block_sizes=SIZES)
    want = attend(*args, memory, starts)
    ctx, blk = ("batch", None, "kv_heads", None), ("batch", None, None, "kv_heads", None)
    rows = ("batch", None)
    mem = BlockMemory(blk, blk, ("batch", None, None))
    in_axes = (("batch", None, None, "heads", None), ctx, ctx, blk, blk, rows, mem, rows)
    with sharding.activation_sharding(mesh8):
        got = jax.jit(sharding.per_shard(attend, in_axes, in_axes[0]))(*args, memory, starts)
    assert got.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    assert sharding.per_shard(attend, in_axes, in_axes[0]) is attend  # no active sharding: unchanged


def test_tile_ranges_skip_context_past_the_largest_anchor():
    anchors = jnp.asarray([[0, 0, 5, 9, 12, 40]])
    starts = jnp.asarray([[0, 0, 0, 0, 10, 10]])
    ranges = ba.pallas_tpu.tile_ranges(anchors, starts, 2, T)
    np.testing.assert_array_equal(ranges, [[[0, 0], [0, 9], [10, 40]]])


def test_dispatcher_falls_back_to_xla_once_per_backend(caplog, monkeypatch):
    monkeypatch.setattr(ba, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger=ba.__name__):
        assert ba.resolve_implementation("pallas", backend="cpu") == "xla"
        assert ba.resolve_implementation("pallas", backend="cpu") == "xla"
        assert ba.resolve_implementation("pallas", backend="metal") == "xla"
        assert ba.resolve_implementation("pallas", backend="gpu") == "pallas"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "backend 'cpu'" in warnings[0] and "chunked XLA" in warnings[0]
    assert ba.resolve_implementation("auto", backend="cpu") == "xla"
    assert ba.resolve_implementation("auto", backend="tpu") == "pallas"
    assert ba.resolve_implementation("auto", backend="gpu") == "xla"  # the GPU kernel is chosen explicitly
    assert ba.resolve_implementation("pallas", interpret=True, backend="cpu") == "pallas"
    assert ba.resolve_implementation("reference", backend="tpu") == "reference"
    with pytest.raises(ValueError, match="unknown block attention implementation 'splash'"):
        ba.resolve_implementation("splash")
    with pytest.raises(ValueError, match="BlockSizes must be positive"):
        BlockSizes(block_q=0)
    # On this CPU backend 'pallas' without interpret runs the XLA path: same numbers as 'xla'.
    args, memory, starts = _inputs("packed_samples", 4, 3)
    np.testing.assert_array_equal(_run(args, memory, starts, "pallas"), _run(args, memory, starts, "xla"))
