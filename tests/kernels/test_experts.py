"""The routed experts' implementations against the dense all-experts reference and a float64 numpy one:
idle experts, uneven routing, every tile size, a device's slice of the experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.kernels import experts

T, K, X, H, INNER = 37, 3, 8, 16, 12
GROUPED = ("tiled", "ragged_dot")


def _weights(seed=0, experts_=X):
    k = jax.random.split(jax.random.key(seed), 3)
    return (
        0.3 * jax.random.normal(k[0], (experts_, H, INNER)),
        0.3 * jax.random.normal(k[1], (experts_, H, INNER)),
        0.3 * jax.random.normal(k[2], (experts_, INNER, H)),
    )


def _tokens(ids_TxK, seed=1):
    k = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k[0], (ids_TxK.shape[0], H)), jax.random.uniform(k[1], ids_TxK.shape)


def _numpy_reference(x, ids, w, gate, up, down, first_expert=0):
    """float64, one pick at a time."""
    x, w, gate, up, down = (np.asarray(a, np.float64) for a in (x, w, gate, up, down))
    y = np.zeros_like(x)
    for t, k in np.ndindex(*np.shape(ids)):
        e = int(ids[t, k]) - first_expert
        if 0 <= e < gate.shape[0]:
            g, u = x[t] @ gate[e], x[t] @ up[e]
            y[t] += w[t, k] * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return y


ROUTES = {
    "random": lambda rng: rng.integers(0, X, (T, K)),
    "all_to_one": lambda rng: np.full((T, K), 5),  # one expert gets every pair, the others idle
    "half_idle": lambda rng: rng.integers(0, X // 2, (T, K)),
    "one_token": lambda rng: rng.permutation(X)[:K][None],  # X - K experts idle
}


@pytest.mark.parametrize("implementation", [*GROUPED, "dense"])
@pytest.mark.parametrize("route", ROUTES)
def test_each_implementation_equals_a_float64_reference(implementation, route):
    ids = jnp.asarray(ROUTES[route](np.random.default_rng(0)), jnp.int32)
    x, w = _tokens(ids)
    weights = _weights()
    got = jax.jit(lambda *a: experts.routed_swiglu(*a, implementation=implementation))(x, ids, w, *weights)
    np.testing.assert_allclose(got, _numpy_reference(x, ids, w, *weights), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tile", [1, 3, 8, 64, 256])
def test_no_pair_is_dropped_at_any_tile_size(tile):
    """Every expert's pairs fill tiles of `tile` rows, however many there are: with every pair on one expert
    (37 x 3 = 111 rows, 14 tiles of 8) or spread, each pick adds its expert's output exactly once."""
    for route in ("all_to_one", "random"):
        ids = jnp.asarray(ROUTES[route](np.random.default_rng(1)), jnp.int32)
        x, w = _tokens(ids, seed=2)
        weights = _weights(3)
        got = experts.routed_swiglu(x, ids, w, *weights, implementation="tiled", tile=tile)
        np.testing.assert_allclose(got, _numpy_reference(x, ids, w, *weights), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("implementation", [*GROUPED, "dense"])
def test_a_slice_of_the_experts_adds_its_own_picks_only(implementation):
    """`first_expert`: a device holding experts 2-4 of 8 (expert parallelism) adds the picks of those."""
    ids = jnp.asarray(ROUTES["random"](np.random.default_rng(4)), jnp.int32)
    x, w = _tokens(ids, seed=5)
    gate, up, down = (a[2:5] for a in _weights(6))
    got = experts.routed_swiglu(x, ids, w, gate, up, down, first_expert=2, implementation=implementation)
    np.testing.assert_allclose(got, _numpy_reference(x, ids, w, gate, up, down, 2), rtol=2e-5, atol=2e-5)


def test_the_plan_sorts_pairs_by_expert_and_leaves_out_experts_held_elsewhere():
    ids = jnp.asarray([[3, 1], [1, 0], [3, 2]], jnp.int32)
    plan = experts.plan(ids, num_experts=2, first_expert=1)  # holds experts 1 and 2
    np.testing.assert_array_equal(plan.local_P, [2, 0, 0, 2, 2, 1])  # 2 = not held (experts 3 and 0)
    np.testing.assert_array_equal(plan.sizes_X, [2, 1])
    np.testing.assert_array_equal(plan.starts_X, [0, 2])
    np.testing.assert_array_equal(plan.order_P, [1, 2, 5, 0, 3, 4])


def test_auto_picks_the_grouped_matmul_on_tpu_and_tiles_elsewhere():
    assert experts.resolve_implementation("auto", backend="tpu") == "ragged_dot"
    assert experts.resolve_implementation("auto", backend="gpu") == "tiled"
    assert experts.resolve_implementation("auto", backend="cpu") == "tiled"
    with pytest.raises(ValueError, match="unknown experts implementation"):
        experts.resolve_implementation("megablox")


def test_default_tiles_follow_the_mean_rows_per_expert():
    assert experts.default_tile(64 * 8, 64) == 8
    assert experts.default_tile(512 * 8, 64) == 64
    assert experts.default_tile(4096 * 10, 512) == 128
    assert experts.default_tile(1, 512) == 8 and experts.default_tile(10**7, 8) == 256
