"""Schedule values at the paper numbers, AdamW + clipping against numpy, and frozen-parameter masking."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dspark_jax.run.optimizer import make_optimizer, make_schedule

PEAK, TOTAL, WARMUP, STOP = 3e-4, 26_040, 1_042, 2_604


def _reference_lr(step: int) -> float:
    """Linear 0 -> PEAK over WARMUP steps, then half-cosine PEAK -> 0 at TOTAL."""
    if step < WARMUP:
        return PEAK * step / WARMUP
    progress = min(step - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    return PEAK * 0.5 * (1 + math.cos(math.pi * progress))


def test_schedule_matches_the_paper_numbers():
    schedule = make_schedule(PEAK, TOTAL, warmup_fraction=0.04)
    assert round(0.04 * TOTAL) == WARMUP and (WARMUP + TOTAL) % 2 == 0
    checkpoints = {0: 0.0, WARMUP // 2: PEAK / 2, WARMUP: PEAK, (WARMUP + TOTAL) // 2: PEAK / 2, TOTAL: 0.0}
    for step, expected in checkpoints.items():
        assert float(schedule(step)) == pytest.approx(expected, abs=PEAK * 1e-6), step
    # optax evaluates in float32: absolute error ~1e-6 of the peak (cancellation near step 0).
    for step in [1, WARMUP - 1, WARMUP + 1, STOP - 1, STOP, 10_000, TOTAL - 1, TOTAL + 5]:
        assert float(schedule(step)) == pytest.approx(_reference_lr(step), rel=1e-5, abs=PEAK * 1e-6), step
    # A one-epoch run stops at STOP, early in the cosine: the LR there is still ~99% of peak.
    assert float(schedule(STOP)) == pytest.approx(
        PEAK * 0.5 * (1 + math.cos(math.pi * 1562 / 24998)), rel=1e-5
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"peak_lr": 3e-4, "total_steps": 0}, "total_steps"),
        ({"peak_lr": 3e-4, "total_steps": 10, "warmup_fraction": 1.0}, "warmup_fraction"),
        ({"peak_lr": 0.0, "total_steps": 10}, "peak_lr"),
    ],
)
def test_schedule_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(**kwargs)


def _numpy_adamw(params, grads_seq, *, lr, clip, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """Reference: clip by global norm, then bias-corrected Adam with decoupled weight decay."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_seq, start=1):
        norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
        scale = min(1.0, clip / norm)
        for k in p:
            g = np.asarray(grads[k], np.float64) * scale
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * p[k])
    return p


def _steps(tx, params, grads_seq):
    """`params` after `tx`'s updates for each gradient of `grads_seq` in turn."""
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    for grads in grads_seq:
        updates, state = tx.update(jax.tree.map(jnp.asarray, grads), state, p)
        p = optax.apply_updates(p, updates)
    return p


def test_adamw_with_clipping_matches_numpy():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    grads_seq = [
        {k: (rng.normal(size=v.shape) * scale).astype(np.float32) for k, v in params.items()}
        for scale in (5.0, 0.1, 3.0)  # global norms above and below the clip
    ]
    p = _steps(make_optimizer(1e-2, weight_decay=0.1, clip_norm=1.0), params, grads_seq)
    expected = _numpy_adamw(params, grads_seq, lr=1e-2, clip=1.0, wd=0.1)
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), expected[k], rtol=1e-5, atol=1e-6)


class _Draft(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.body = nnx.Linear(6, 5, rngs=rngs)
        self.reranker = nnx.Linear(5, 4, rngs=rngs)


def _trainable(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "reranker" not in jax.tree_util.keystr(path), params
    )


def test_frozen_parameters_get_no_updates_and_no_state():
    _, params = nnx.split(_Draft(nnx.Rngs(0)), nnx.Param)
    tx = make_optimizer(1e-2, clip_norm=1.0, trainable_mask=_trainable)
    state = tx.init(params)

    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    trainable_size = sum(x.size for x in jax.tree.leaves(params["body"]))
    assert sum(x.size for x in floats) == 2 * trainable_size  # mu and nu for the body only
    assert all(x.dtype == jnp.float32 for x in floats)

    # Independent computation: the unmasked optimizer on the trainable subtree alone (the
    # frozen gradients, large here, must not enter the clipping norm either).
    body = params["body"]
    ref_tx = make_optimizer(1e-2, clip_norm=1.0)
    ref_state = ref_tx.init(body)
    for i in range(3):
        grads = jax.tree.map(lambda x, i=i: jnp.full_like(x, 10.0 * (i + 1)) + x, params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = ref_tx.update(grads["body"], ref_state, body)
        body = optax.apply_updates(body, ref_updates)

    _, initial = nnx.split(_Draft(nnx.Rngs(0)), nnx.Param)
    for got, want in zip(jax.tree.leaves(params["reranker"]), jax.tree.leaves(initial["reranker"])):
        np.testing.assert_array_equal(got, want)
    for got, want, before in zip(
        jax.tree.leaves(params["body"]), jax.tree.leaves(body), jax.tree.leaves(initial["body"])
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert not np.allclose(got, before)


def test_scaled_parameters_learn_at_their_share_of_the_rate_with_one_clipping_norm():
    """`scaled_mask` + `lr_scale` (`train.copied_lr_scale`): the marked leaves follow AdamW at `lr_scale` x
    the rate, the others at the rate, both after one global-norm clip over every leaf (numpy reference);
    with frozen leaves besides, those still get nothing."""
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    grads_seq = [
        {k: (rng.normal(size=v.shape) * s).astype(np.float32) for k, v in params.items()} for s in (4, 0.2)
    ]
    tx = make_optimizer(
        1e-2, weight_decay=0.1, clip_norm=1.0, scaled_mask={"w": True, "b": False}, lr_scale=0.25
    )
    p = _steps(tx, params, grads_seq)
    slow = _numpy_adamw(params, grads_seq, lr=2.5e-3, clip=1.0, wd=0.1)
    fast = _numpy_adamw(params, grads_seq, lr=1e-2, clip=1.0, wd=0.1)
    np.testing.assert_allclose(np.asarray(p["w"]), slow["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(p["b"]), fast["b"], rtol=1e-5, atol=1e-6)

    _, draft = nnx.split(_Draft(nnx.Rngs(0)), nnx.Param)
    body_kernel = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "body" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path),
        params,
    )
    tx = make_optimizer(1e-2, trainable_mask=_trainable, scaled_mask=body_kernel, lr_scale=0.5)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, draft), tx.init(draft), draft)
    assert not any(np.any(x) for x in jax.tree.leaves(updates["reranker"]))
    np.testing.assert_allclose(
        updates["body"]["kernel"].get_value(), 0.5 * updates["body"]["bias"].get_value()[0]
    )
