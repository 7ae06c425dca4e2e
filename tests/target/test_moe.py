"""The sparse MoE block against transformers' Qwen3-MoE, Qwen3-Next and Qwen 3.5-MoE blocks, and its own
dense reference."""

import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import sharding
from dspark_jax.target.moe import SparseMoE, dense_reference
from tests.references import reference

torch = reference("torch")
transformers = reference("transformers")

H, X, K, INNER, SHARED = 32, 8, 4, 16, 24
IMPLEMENTATIONS = ("tiled", "ragged_dot", "dense")  # 'auto' is 'tiled' here (CPU)
# (model, norm_topk_prob): Qwen3-Next reuses Qwen2-MoE's block (shared expert), Qwen 3.5-MoE reuses
# Qwen3-Next's with a router that always renormalises (its config has no `norm_topk_prob`).
KINDS = [
    ("qwen3_moe", True),
    ("qwen3_moe", False),
    ("qwen3_next", True),
    ("qwen3_next", False),
    ("qwen3_5_moe", True),
]


def _hf_block(kind, norm_topk_prob):
    """A tiny transformers block with N(0, 0.3) weights (the router's default zeros tie every expert)."""
    torch.manual_seed(0)
    common = dict(hidden_size=H, num_experts=X, num_experts_per_tok=K, moe_intermediate_size=INNER)
    models = transformers.models
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, norm_topk_prob=norm_topk_prob)
        block = models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    elif kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **common, shared_expert_intermediate_size=SHARED, norm_topk_prob=norm_topk_prob
        )
        block = models.qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock(config)
    else:
        config = transformers.Qwen3_5MoeTextConfig(**common, shared_expert_intermediate_size=SHARED)
        block = models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.eval()


def _copy(hf_block, moe):
    """The transformers block's weights into ours. Its experts are fused: `gate_up_proj [X, 2I, H]` holds
    the gate rows then the up rows; `down_proj` is `[X, H, I]`; linear weights are `[out, in]`."""
    get = lambda t: jnp.asarray(t.detach().numpy())
    moe.router.kernel.set_value(get(hf_block.gate.weight).T)
    gate_up_Xx2IxH = get(hf_block.experts.gate_up_proj)
    moe.gate_XxHxI.set_value(gate_up_Xx2IxH[:, :INNER].transpose(0, 2, 1))
    moe.up_XxHxI.set_value(gate_up_Xx2IxH[:, INNER:].transpose(0, 2, 1))
    moe.down_XxIxH.set_value(get(hf_block.experts.down_proj).transpose(0, 2, 1))
    if moe.shared is not None:
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            getattr(moe.shared, ours).kernel.set_value(get(getattr(hf_block.shared_expert, theirs).weight).T)
        moe.shared_gate.kernel.set_value(get(hf_block.shared_expert_gate.weight).T)


def _pair(kind, norm_topk_prob, dtype=jnp.float32, implementation="auto"):
    block = _hf_block(kind, norm_topk_prob)
    shared = 0 if kind == "qwen3_moe" else SHARED
    moe = SparseMoE(
        H,
        X,
        K,
        INNER,
        norm_topk_prob=norm_topk_prob,
        shared_intermediate=shared,
        rngs=nnx.Rngs(0),
        dtype=dtype,
        implementation=implementation,
    )
    _copy(block, moe)
    return block, moe


def _tokens(shape, seed=1):
    return np.random.default_rng(seed).normal(size=(*shape, H)).astype(np.float32)


def _block_output(block, x):
    with torch.no_grad():
        out = block(torch.tensor(x))
    return (out[0] if isinstance(out, tuple) else out).numpy()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind, norm_topk_prob", KINDS)
def test_block_equals_transformers(kind, norm_topk_prob, implementation):
    block, moe = _pair(kind, norm_topk_prob, implementation=implementation)
    x = _tokens((2, 12))
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))), _block_output(block, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind, norm_topk_prob", KINDS)
def test_block_equals_transformers_with_idle_experts(kind, norm_topk_prob, implementation):
    block, moe = _pair(kind, norm_topk_prob, implementation=implementation)
    x = _tokens((1, 1))  # one token: X - K experts get no row (empty groups in every ragged_dot)
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))), _block_output(block, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, norm_topk_prob", KINDS)
def test_route_equals_the_torch_router(kind, norm_topk_prob):
    block, moe = _pair(kind, norm_topk_prob)
    x = _tokens((40,), seed=2)
    with torch.no_grad():
        _, ref_weights, ref_ids = block.gate(torch.tensor(x))
    ids, weights = moe.route(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(ids), ref_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), ref_weights.numpy(), rtol=1e-6, atol=1e-7)


def _dense_routing(ids_NxK, weights_NxK):
    """The `[N, X]` routing matrix: the same for two top-k results that order tied experts differently."""
    routing_NxX = np.zeros((ids_NxK.shape[0], X), np.float32)
    np.put_along_axis(routing_NxX, np.asarray(ids_NxK), np.asarray(weights_NxK, np.float32), axis=1)
    return routing_NxX


def test_route_weights_take_the_activation_dtype():
    """bfloat16 activations: the softmax runs in float32 and the weights come back in bfloat16, as torch's.
    bfloat16 logits tie often, and torch's top-k orders tied experts differently from JAX's: the routes are
    compared as dense routing matrices."""
    block, moe = _pair("qwen3_moe", True, dtype=jnp.bfloat16)
    x = _tokens((40,), seed=3)
    with torch.no_grad():
        _, ref_weights, ref_ids = block.gate.to(torch.bfloat16)(torch.tensor(x, dtype=torch.bfloat16))
    ids, weights = moe.route(jnp.asarray(x, jnp.bfloat16))
    assert weights.dtype == jnp.bfloat16 and ref_weights.dtype == torch.bfloat16
    np.testing.assert_allclose(
        _dense_routing(ids, weights), _dense_routing(ref_ids.numpy(), ref_weights.float().numpy()), atol=4e-3
    )


def _random_moe(shared, seed, implementation="auto"):
    """A SparseMoE with its N(0, 0.02) weights scaled to N(0, 0.3): outputs of order one, distinct routes."""
    moe = SparseMoE(
        H,
        X,
        K,
        INNER,
        norm_topk_prob=True,
        shared_intermediate=shared,
        rngs=nnx.Rngs(seed),
        implementation=implementation,
    )
    nnx.update(moe, jax.tree.map(lambda p: 15 * p, nnx.state(moe, nnx.Param)))
    return moe


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shared", [0, SHARED])
def test_sparse_forward_equals_the_dense_reference(shared, implementation):
    moe = _random_moe(shared, seed=3, implementation=implementation)
    x = jax.random.normal(jax.random.key(4), (3, 17, H))
    np.testing.assert_allclose(np.asarray(moe(x)), np.asarray(dense_reference(moe, x)), rtol=1e-5, atol=1e-5)


def test_sparse_forward_equals_the_dense_reference_under_jit():
    moe = _random_moe(SHARED, seed=5)
    graphdef, state = nnx.split(moe)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    x = jax.random.normal(jax.random.key(6), (2, 9, H))
    np.testing.assert_allclose(
        np.asarray(forward(state, x)), np.asarray(dense_reference(moe, x)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "mesh_shape",
    [
        {"data": 1, "fsdp": 2, "tensor": 1},
        {"data": 2, "fsdp": 2, "tensor": 2},
        {"data": 1, "fsdp": 8, "tensor": 1},
    ],
)
@pytest.mark.parametrize("rows", [4, 3])
def test_expert_parallel_forward_equals_the_unsharded_one(mesh_shape, rows):
    """The default rules split the experts whole over 'fsdp': each device holds X / n of them, the tokens
    come to them (all-gather) and go back summed (reduce-scatter) under `shard_map`. The output equals the
    one-device forward, with tokens split over the expert axis (4 rows) or replicated along it (3 rows)."""
    moe = _random_moe(SHARED, seed=7)
    graphdef, state = nnx.split(moe)
    x = jax.random.normal(jax.random.key(8), (rows, 9, H))
    mesh = sharding.make_mesh(mesh_shape, jax.devices()[: math.prod(mesh_shape.values())])
    placed = jax.device_put(state, sharding.state_shardings(state, mesh))
    fsdp = mesh_shape["fsdp"]
    assert placed["gate_XxHxI"].sharding.shard_shape((X, H, INNER))[:2] == (X // fsdp, H)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    with sharding.activation_sharding(mesh):
        lowered = forward.lower(placed, sharding.shard_batch(x, mesh))
        got = forward(placed, sharding.shard_batch(x, mesh))
    text = lowered.as_text()
    assert "all_gather" in text or rows % (mesh_shape["data"] * fsdp), "tokens split over the experts' axis"
    assert "reduce_scatter" in text or "all_reduce" in text
    np.testing.assert_allclose(np.asarray(got), np.asarray(moe(x)), rtol=1e-5, atol=1e-5)


def test_the_moe_benchmark_runs_at_tiny_shapes():
    """`benchmarks/moe_forward.py --quick`: the script the accelerator check runs, at CPU-sized shapes."""
    out = subprocess.run(
        [sys.executable, "benchmarks/moe_forward.py", "--quick"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("8", "tiled"), ("8", "dense"), ("64", "tiled"), ("64", "dense")]
