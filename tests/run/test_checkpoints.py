"""Checkpointer: sharded train state + grain iterator round trip, step bookkeeping, mismatch errors."""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.run.checkpoints import Checkpointer


class _Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = nnx.Linear(16, 4, rngs=rngs)


def _spec(ndim: int, flip: bool) -> P:
    axes = ("tensor", "fsdp") if flip else ("fsdp", "tensor")
    return P(*axes[:ndim])


def _train_state(mesh, *, flip: bool = False):
    """params + AdamW state (after two updates, so the moments are non-zero) + step, sharded on `mesh`."""
    _, params = nnx.split(_Tiny(nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    for i in range(2):
        grads = jax.tree.map(lambda x, i=i: jnp.sin(x + i), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    state = {"params": params, "opt_state": opt_state, "step": jnp.asarray(2, jnp.int32)}
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _spec(x.ndim, flip))), state)


def _abstract(state, mesh, *, flip: bool):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(x.ndim, flip))),
        state,
    )


def _iterator():
    return iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_restores_sharded_state_iterator_and_meta(tmp_path, mesh8, async_save):
    state = _train_state(mesh8)
    it = _iterator()
    for _ in range(3):
        next(it)
    with Checkpointer(tmp_path / "ckpt", async_save=async_save) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(2, state, data_iter=it, meta={"config": {"lr": 3e-4}, "metrics_step": 2})
        expected_batches = [next(it) for _ in range(3)]  # advancing after save must not leak into it
        ckpt.wait()

    # A fresh process would do exactly this: new manager, new pipeline, abstract state.
    abstract = _abstract(state, mesh8, flip=True)  # restore onto a different layout
    fresh = _iterator()
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() == 2
        restored, meta = ckpt.restore(None, abstract, data_iter=fresh)

    assert meta == {"config": {"lr": 3e-4}, "metrics_step": 2}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want, target in zip(
        jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(abstract)
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.dtype == want.dtype
        assert got.sharding.is_equivalent_to(target.sharding, got.ndim)
    assert restored["params"]["up"]["kernel"].sharding.spec == P("tensor", "fsdp")
    for want in expected_batches:
        np.testing.assert_array_equal(next(fresh), want)


def test_steps_interval_force_and_retention(tmp_path, mesh1):
    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.asarray(0)}
    with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=4) as ckpt:
        saved = {step: ckpt.save(step, state) for step in range(1, 10)}
        assert [s for s, ok in saved.items() if ok] == [4, 8]
        assert ckpt.save(9, state, force=True)  # e.g. the preemption or final save
        assert not ckpt.save(9, state, force=True)  # a step is saved once
        assert ckpt.all_steps() == [8, 9]
        assert ckpt.latest_step() == 9
        with pytest.raises(FileNotFoundError, match="step 4"):
            ckpt.restore(4, state)
        restored, meta = ckpt.restore(
            8, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        )
    assert meta == {}
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_restore_from_empty_directory_and_without_iterator_state(tmp_path):
    state = {"w": jnp.ones(3)}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            ckpt.restore(None, state)
        ckpt.save(1, state)
        with pytest.raises(ValueError, match="no data iterator state"):
            ckpt.restore(1, state, data_iter=_iterator())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s["params"]["up"].__setitem__("kernel", jnp.zeros((8, 32))),
            r"'params\.up\.kernel' has shape",
        ),
        (
            lambda s: s["params"].__setitem__("extra", jnp.zeros(3)),
            r"missing from the checkpoint: params\.extra",
        ),
        (
            lambda s: s["params"]["down"].pop("bias"),
            r"in the checkpoint but not in the model: params\.down\.bias",
        ),
    ],
)
def test_mismatching_target_names_the_bad_key_paths(tmp_path, edit, message):
    state = {
        "params": {
            "up": {"kernel": jnp.ones((8, 16))},
            "down": {"kernel": jnp.ones((16, 4)), "bias": jnp.ones(4)},
        }
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        edit(target)
        with pytest.raises(ValueError, match=message) as info:
            ckpt.restore(3, target)
    assert str(tmp_path / "3") in str(info.value)


def test_restore_params_reads_only_the_params(tmp_path, mesh8):
    """Inference restores the parameters alone, into another sharding, without building optimizer state."""
    state = _train_state(mesh8)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, state, meta={"step": 2}, force=True)
    abstract_params = _abstract({"params": state["params"]}, mesh8, flip=True)["params"]
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.meta(2) == {"step": 2}
        params = ckpt.restore_params(None, abstract_params)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.spec == _spec(got.ndim, True)
    bad = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((*x.shape[:-1], x.shape[-1] + 1), x.dtype), abstract_params
    )
    with (
        Checkpointer(tmp_path / "ckpt") as ckpt,
        pytest.raises(ValueError, match=r"has shape .* in the checkpoint"),
    ):
        ckpt.restore_params(2, bad)
