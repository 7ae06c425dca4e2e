"""The Mosaic GPU block attention kernel against the dense reference: in JAX's GPU interpret mode on CPU
(compiled on a GPU backend), and compiled for H200 ahead of time where the CUDA plugin is installed."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.kernels.block_attention import BlockMemory, BlockSizes, block_attention, pallas_gpu
from dspark_jax.kernels.block_attention.pallas import block_attention_pallas
from dspark_jax.training import topology
from tests import bf16
from tests.kernels.test_pallas_block_attention import _inputs

D = 64  # the demo head dim (WGMMA: a multiple of 16)
INTERPRET = jax.default_backend() != "gpu"
SIZES = BlockSizes(block_k=64)
# Every crafted layout once; GQA ratios 1, 4 and 12 and memory present and absent all appear.
CASES = [
    ("first_anchor_at_0", 1, 0, 40),
    ("anchors_at_the_end", 4, 3, 40),
    ("repeated_anchors", 12, 3, 40),
    ("padded_blocks", 12, 0, 40),
    ("tiles_without_context", 4, 0, 40),
    ("packed_samples", 1, 3, 200),  # 4 context tiles of 64: tiles past the largest anchor are skipped
]


def _upcast(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, tree)


def _gpu(args, memory, starts, **kw):
    return block_attention_pallas(
        *args, memory, starts, platform="gpu", interpret=INTERPRET, block_sizes=SIZES, **kw
    )


def _rounded_like_the_kernel(args, memory, starts, tile):
    """The kernel's bf16 arithmetic, densely, per block: bf16 inputs (queries scaled by `D**-0.5` and
    rounded), fp32 scores, each visible key's probability `exp(score - m)` rounded to bf16 against the
    running max `m` of the key tiles read up to its own (context tiles, then the blocks' own slots and
    memory, `tile` keys each, in the kernel's key order), fp32 sums, the output left in fp32 (the caller
    rounds it). Visibility is written out here, independently of the kernel and of `reference.py`."""
    q, k_ctx, v_ctx, k_blk, v_blk = (np.asarray(x, np.float32) for x in args[:5])
    b, n, s, heads, d = q.shape
    t, g = k_ctx.shape[1:3]
    local_k, local_v, local_visible = [k_blk], [v_blk], [np.ones((b, n, s), bool)]
    if memory is not None:
        local_k.append(np.asarray(memory.k_BxNxMxGxD, np.float32))
        local_v.append(np.asarray(memory.v_BxNxMxGxD, np.float32))
        local_visible.append(np.asarray(memory.valid_BxNxM))
    per_block = lambda ctx_BxTxGxD: np.broadcast_to(ctx_BxTxGxD[:, None], (b, n, *ctx_BxTxGxD.shape[1:]))
    # T here: one block's keys, the context then its own slots and memory.
    k_BxNxTxGxD = np.concatenate([per_block(k_ctx), *local_k], axis=2)
    v_BxNxTxGxD = np.concatenate([per_block(v_ctx), *local_v], axis=2)
    j_T = np.arange(t)
    starts, anchors = np.asarray(starts)[..., None], np.asarray(args[5])[..., None]
    visible_BxNxT = np.concatenate([(j_T >= starts) & (j_T < anchors), *local_visible], axis=2)
    per_block_keys = k_BxNxTxGxD.shape[2] - t  # S + M, laid out block after block after the context
    local_index = np.arange(n)[:, None] * per_block_keys + np.arange(per_block_keys)
    tile_NxT = np.concatenate([np.broadcast_to(j_T // tile, (n, t)), -(-t // tile) + local_index // tile], 1)

    q_BxNxSxGxExD = bf16.rounded(q * d**-0.5).reshape(b, n, s, g, heads // g, d)
    scores = np.einsum("bnsged,bntgd->bnsget", q_BxNxSxGxExD, k_BxNxTxGxD)
    visible = visible_BxNxT[:, :, None, None, None]
    scores = np.where(visible, scores, -np.inf)
    tiles = int(tile_NxT.max()) + 1
    in_tile = tile_NxT[None, :, None, None, None, :, None] == np.arange(tiles)
    running_max = np.maximum.accumulate(np.where(in_tile, scores[..., None], -np.inf).max(axis=-2), axis=-1)
    tile_index = np.broadcast_to(tile_NxT[None, :, None, None, None], scores.shape)
    m_at_key = np.take_along_axis(running_max, tile_index, axis=-1)
    with np.errstate(invalid="ignore"):  # keys no row sees: -inf - -inf, masked just below
        p = np.where(visible, np.exp(scores - m_at_key), 0.0)
        rescale = np.where(visible, np.exp(m_at_key - running_max[..., -1:]), 0.0)
    out = np.einsum("bnsget,bntgd->bnsged", bf16.rounded(p) * rescale, v_BxNxTxGxD)
    total = np.sum(p * rescale, axis=-1)[..., None]
    return (out / total).reshape(b, n, s, heads, d)


@pytest.mark.parametrize(("layout", "ratio", "memory_slots", "t"), CASES)
def test_forward_equals_the_dense_reference_bf16(layout, ratio, memory_slots, t):
    args, memory, starts = _inputs(layout, ratio, memory_slots, dtype=jnp.bfloat16, d=D, t=t)
    got = jax.jit(_gpu)(args, memory, starts)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    # Against the kernel's own rounding: equal in bf16 but for a few elements, mostly where a probability
    # sat on a bf16 rounding boundary that numpy's fp32 exp and the kernel's round to different sides (a
    # GPU's exp differs too). Measured in interpret mode: at most 0.043% of the elements differ (28 of
    # 64,512, padded_blocks), by at most 6.0e-4 beyond half a bf16 step (with XLA's exp here: 9 of 193,536
    # over all cases, one step each). A mask one key off, or an fp32 sum kept in bf16, fails here by far.
    tile = pallas_gpu.key_tile(SIZES.block_k, D, jnp.dtype(jnp.bfloat16).itemsize)
    rounded = _rounded_like_the_kernel(args, memory, starts, tile)
    differ = (bf16.steps(got, bf16.rounded(rounded)) > 0).mean()
    assert differ <= 1e-3, f"{differ:.3%} of the elements differ from the kernel's rounding"
    np.testing.assert_allclose(got, rounded, rtol=2**-8, atol=1e-3)
    # Against the fp32 dense reference on the same inputs: half a bf16 step of output rounding (rtol) and
    # the rounding of the probabilities (atol; measured at most 2.4e-3 beyond rtol, mean error 5.4e-4).
    want = np.asarray(block_attention(*_upcast(args), _upcast(memory), starts, implementation="reference"))
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=3e-3)
    assert np.abs(got - want).mean() <= 6e-4


def test_gradients_equal_the_dense_reference():
    """The custom VJP's backward (the chunked XLA path) behind the GPU forward."""
    args, memory, starts = _inputs("packed_samples", 4, 3, dtype=jnp.bfloat16, seed=1, d=D)
    cot = jax.random.normal(jax.random.key(7), args[0].shape)

    def loss(attend, q, k_ctx, v_ctx, k_blk, v_blk, mem_kv):
        mem = BlockMemory(*mem_kv, memory.valid_BxNxM)
        out = attend((q, k_ctx, v_ctx, k_blk, v_blk, args[5]), mem, starts)
        return jnp.sum(out.astype(jnp.float32) * cot)

    reference = lambda a, mem, st: block_attention(*a, mem, st, implementation="reference")
    inputs = (*_upcast(args[:5]), (_upcast(memory.k_BxNxMxGxD), _upcast(memory.v_BxNxMxGxD)))
    want = jax.grad(lambda *x: loss(reference, *x), argnums=tuple(range(6)))(*inputs)
    inputs = (*args[:5], (memory.k_BxNxMxGxD, memory.v_BxNxMxGxD))
    got = jax.jit(jax.grad(lambda *x: loss(_gpu, *x), argnums=tuple(range(6))))(*inputs)
    # bf16 gradients (the XLA backward on bf16 inputs) against fp32: half a bf16 step (rtol) plus the bf16
    # rounding inside the backward (atol; measured at most 7.2e-3 beyond rtol, mean error at most 9.6e-4).
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=2**-8, atol=1e-2)
        assert np.abs(g - w).mean() <= 1.2e-3


def test_tile_ranges_read_only_context_in_range_and_the_tiles_own_blocks():
    """Hand-worked: N=4 blocks of S*E = 40 rows (two row tiles of 64), 3 keys per block (S=2, M=1), T=150
    context in tiles of 64 (3 tiles, local keys from tile 3)."""
    anchors, starts = jnp.asarray([[0, 70, 70, 130]]), jnp.asarray([[0, 0, 65, 65]])
    per_row = lambda x_BxN: jnp.pad(jnp.repeat(x_BxN, 40, axis=1), [(0, 0), (0, 32)])  # 3 row tiles
    rows = jnp.stack([per_row(anchors), per_row(starts), per_row(jnp.arange(4)[None])], axis=1)
    ranges = pallas_gpu.tile_ranges(rows, 4, 40, 3, 150, 64)
    # Tile 0: rows 0-63 = blocks 0, 1 (anchors 0, 70; starts 0) -> context [0, 70) = tiles [0, 2).
    # Tile 1: rows 64-127 = blocks 1-3 -> [0, 130) = tiles [0, 3); tile 2: rows 128-159 = block 3 ->
    # [65, 130) = tiles [1, 3). Local keys: blocks 0-1 = keys 0-5 -> tile 3; blocks 1-3 -> keys 3-11.
    np.testing.assert_array_equal(ranges, [[[0, 2, 3, 4], [0, 3, 3, 4], [1, 3, 3, 4]]])


def test_bad_shapes_and_dtypes_are_refused_or_fall_back(caplog):
    with pytest.raises(ValueError, match="head dim that is a multiple of 16, got 8"):
        pallas_gpu.key_tile(128, 8, 2)
    assert pallas_gpu.key_tile(128, 256, 2) == 64  # paper head dim: the tile halves to fit shared memory
    assert pallas_gpu.key_tile(128, 64, 2) == 128
    with pytest.raises(ValueError, match="no Pallas block attention kernel for platform 'rocm'"):
        block_attention_pallas(*_inputs("packed_samples", 1, 0)[0], platform="rocm")


@pytest.mark.skipif(
    not topology.has_compiler("cuda"),
    reason="needs JAX's CUDA plugin (pip install 'jax[cuda12-local]'), which compiles for a GPU without one",
)
def test_the_kernel_compiles_for_h200_ahead_of_time():
    """Lowered by Mosaic GPU and compiled by XLA's CUDA compiler for an H200 on this host (nothing runs)."""
    script = (
        "import jax, jax.numpy as jnp\n"
        "from dspark_jax.training import topology\n"
        "from dspark_jax.kernels.block_attention import pallas_gpu\n"
        "mesh = jax.sharding.Mesh(topology.compile_devices('h200x8')[:1], ('x',))\n"
        "spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, "
        "sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))\n"
        "for d in (64, 256):\n"
        "    args = (spec(1, 16, 7, 24, d), spec(1, 512, 2, d), spec(1, 512, 2, d), spec(1, 16, 7, 2, d),\n"
        "            spec(1, 16, 7, 2, d), spec(1, 16, dtype=jnp.int32), spec(1, 16, dtype=jnp.int32))\n"
        "    f = lambda *a: pallas_gpu.forward(*a, None, 128, False)\n"
        "    text = jax.jit(f).lower(*args).compile().as_text()\n"
        "    assert 'mosaic_gpu' in text, text[:200]\n"
        "print('compiled')\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
