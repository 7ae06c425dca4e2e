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
from dspark_jax.train import topology
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


@pytest.mark.parametrize(("layout", "ratio", "memory_slots", "t"), CASES)
def test_forward_equals_the_dense_reference_bf16(layout, ratio, memory_slots, t):
    args, memory, starts = _inputs(layout, ratio, memory_slots, dtype=jnp.bfloat16, d=D, t=t)
    want = block_attention(*_upcast(args), _upcast(memory), starts, implementation="reference")
    got = jax.jit(_gpu)(args, memory, starts)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


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
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=5e-2, rtol=5e-2)


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
        "from dspark_jax.train import topology\n"
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
