"""Chunked XLA block attention against the dense masked reference, forward and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.kernels.block_attention import BlockMemory, block_attention


def _inputs(seed, b=2, n=5, s=7, t=23, heads=4, kv_heads=2, d=8, m=0):
    keys = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(keys[0], (b, n, s, heads, d))
    k_ctx = jax.random.normal(keys[1], (b, t, kv_heads, d))
    v_ctx = jax.random.normal(keys[2], (b, t, kv_heads, d))
    k_blk = jax.random.normal(keys[3], (b, n, s, kv_heads, d))
    v_blk = jax.random.normal(keys[4], (b, n, s, kv_heads, d))
    anchors = jnp.sort(jax.random.randint(keys[5], (b, n), 0, t), axis=1)  # includes anchor 0: no context
    memory = None
    if m:
        memory = BlockMemory(
            jax.random.normal(keys[6], (b, n, m, kv_heads, d)),
            jax.random.normal(keys[7], (b, n, m, kv_heads, d)),
            jax.random.bernoulli(keys[6], 0.6, (b, n, m)),
        )
    return (q, k_ctx, v_ctx, k_blk, v_blk, anchors), memory


@pytest.mark.parametrize("chunk", [1, 2, 5, 16])
@pytest.mark.parametrize("m", [0, 6])
def test_xla_matches_reference(chunk, m):
    args, memory = _inputs(0, m=m)
    ref = block_attention(*args, memory, implementation="reference")
    got = block_attention(*args, memory, implementation="xla", anchor_chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_gradients_match_reference():
    args, memory = _inputs(1, m=3)
    cot = jax.random.normal(jax.random.key(9), args[0].shape)

    def loss(impl, q, k_ctx, v_ctx, k_blk, v_blk, mk, mv):
        mem = BlockMemory(mk, mv, memory.valid_BxNxM)
        out = block_attention(
            q, k_ctx, v_ctx, k_blk, v_blk, args[5], mem, implementation=impl, anchor_chunk=2
        )
        return jnp.sum(out * cot)

    diff = (0, 1, 2, 3, 4, 5, 6)
    inputs = (*args[:5], memory.k_BxNxMxGxD, memory.v_BxNxMxGxD)
    want = jax.grad(lambda *x: loss("reference", *x), argnums=diff)(*inputs)
    got = jax.grad(lambda *x: loss("xla", *x), argnums=diff)(*inputs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5, rtol=5e-5)


def test_visibility_rule():
    """Context >= a and other blocks never change a block's output; context < a does."""
    (q, k_ctx, v_ctx, k_blk, v_blk, _), _ = _inputs(2, b=1, n=3, t=30)
    anchors = jnp.asarray([[4, 10, 20]])
    base = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors)
    later = block_attention(q, k_ctx, v_ctx.at[:, 10:].add(5.0), k_blk, v_blk, anchors)
    np.testing.assert_array_equal(np.asarray(later[:, 1]), np.asarray(base[:, 1]))
    np.testing.assert_array_equal(np.asarray(later[:, 0]), np.asarray(base[:, 0]))
    assert not np.allclose(np.asarray(later[:, 2]), np.asarray(base[:, 2]))
    other = block_attention(q, k_ctx, v_ctx, k_blk.at[:, 0].add(3.0), v_blk.at[:, 0].add(3.0), anchors)
    np.testing.assert_array_equal(np.asarray(other[:, 1:]), np.asarray(base[:, 1:]))
    earlier = block_attention(q, k_ctx, v_ctx.at[:, 9].add(5.0), k_blk, v_blk, anchors)
    assert not np.allclose(np.asarray(earlier[:, 1]), np.asarray(base[:, 1]))


def test_memory_is_bounded_at_paper_shapes():
    """One micro-batch row at the paper's shapes: the chunked version never holds NS x T scores per head."""
    b, n, s, t, q, g, d = 1, 512, 7, 4096, 24, 2, 256  # sizes in the legend's letters
    shapes = [(b, n, s, q, d), (b, t, g, d), (b, t, g, d), (b, n, s, g, d), (b, n, s, g, d)]
    args = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in shapes] + [jax.ShapeDtypeStruct((b, n), jnp.int32)]

    def f(*a):
        return jnp.sum(block_attention(*a, implementation="xla", anchor_chunk=16).astype(jnp.float32))

    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*args).compile()
    dense_scores = b * q * n * s * t * 4
    assert compiled.memory_analysis().temp_size_in_bytes < dense_scores / 2  # not even one dense score tensor
