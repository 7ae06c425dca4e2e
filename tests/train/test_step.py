"""The update step: loss normalised on device, invariant to the device count and to micro-batching."""

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import experiments, sharding
from dspark_jax.data import batch as batch_lib
from dspark_jax.data.pipeline import to_global
from dspark_jax.draft import objective
from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
from dspark_jax.train import step as step_lib

CFG = DraftConfig(
    hidden_size=32,
    vocab_size=64,
    num_aux=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    markov_rank=16,
    anchor_chunk=2,
)
B, T, N = 8, 24, 4
BASELINE = experiments.get("baseline")


def _batch():
    host = batch_lib.synthetic(
        B, batch_lib.Dims(T, CFG.num_aux, CFG.hidden_size, N), CFG.vocab_size, prompt_length=6
    )
    # Shorter rows: some blocks run past the response end and some rows have padding blocks.
    host["loss_mask"][::3, 12:] = 0
    return batch_lib.device_fields(host)


def _setup(mesh):
    graphdef, params, rest = nnx.split(DSparkDraft(CFG, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = jax.device_put(params, sharding.state_shardings(params, mesh))
    rest = jax.device_put(rest, NamedSharding(mesh, PartitionSpec()))
    keys = jax.random.split(jax.random.key(1))
    frozen = FrozenTarget(
        jax.random.normal(keys[0], (CFG.vocab_size, CFG.hidden_size)),
        jax.random.normal(keys[1], (CFG.hidden_size, CFG.vocab_size)),
    )
    return graphdef, params, rest, jax.device_put(frozen, NamedSharding(mesh, PartitionSpec()))


def _grads_and_loss(mesh, micro_batches):
    """Accumulated micro-steps, normalised once: `(grads, loss, sharded grads)`."""
    graphdef, params, rest, frozen = _setup(mesh)
    step = jax.jit(functools.partial(step_lib.micro_step, graphdef=graphdef, experiment=BASELINE))
    grads = sums = None
    for micro in micro_batches:
        g, s = step(params, rest, frozen, to_global(micro, mesh))
        grads, sums = (g, s) if grads is None else step_lib.accumulate((grads, sums), (g, s))
    grads = jax.jit(functools.partial(step_lib.normalised_grads, experiment=BASELINE))(grads, sums)
    return jax.device_get(grads), float(objective.loss_from_sums(sums)), grads


def _assert_grads_close(a, b, rtol):
    flat_a, flat_b = nnx.to_flat_state(a), dict(nnx.to_flat_state(b))
    for path, value in flat_a:
        np.testing.assert_allclose(
            np.asarray(flat_b[path].get_value()),
            np.asarray(value.get_value()),
            rtol=rtol,
            atol=2e-6,
            err_msg=str(path),
        )


def test_one_device_equals_eight_sharded_devices(mesh1, mesh8):
    batch = _batch()
    grads1, loss1, _ = _grads_and_loss(mesh1, [batch])
    grads8, loss8, sharded = _grads_and_loss(mesh8, [batch])
    kernel = sharded["layers"][0]["mlp"]["gate"]["kernel"].get_value()
    assert not kernel.sharding.is_fully_replicated  # fsdp/tensor sharded, batch over data x fsdp
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    _assert_grads_close(grads1, grads8, rtol=2e-4)


def test_micro_batches_equal_the_whole_batch_and_the_gradient_of_the_normalised_loss(mesh1):
    batch = _batch()
    halves = [{k: v[i * 4 : (i + 1) * 4] for k, v in batch.items()} for i in range(2)]
    whole, loss, _ = _grads_and_loss(mesh1, [batch])
    grads, parts_loss, _ = _grads_and_loss(mesh1, halves)
    np.testing.assert_allclose(parts_loss, loss, rtol=1e-6)
    _assert_grads_close(whole, grads, rtol=1e-4)
    # Independent check: jax.grad of the globally normalised loss of the whole batch.
    graphdef, params, rest, frozen = _setup(mesh1)
    direct = jax.grad(
        lambda p: objective.loss_from_sums(BASELINE.train_sums(nnx.merge(graphdef, p, rest), frozen, batch))
    )(params)
    _assert_grads_close(jax.device_get(direct), whole, rtol=1e-4)
