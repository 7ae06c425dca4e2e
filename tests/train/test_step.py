"""The update step: the same batch gives the same loss and gradients on 1 device and on 8 sharded devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import sharding
from dspark_jax.data import anchors as anchors_lib
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


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.uint8)
    mask[:, 6:] = 1
    anchors, keep = zip(*(anchors_lib.sample_anchors(m, N, rng) for m in mask))
    anchors, keep = np.stack(anchors), np.stack(keep)
    return {
        "input_ids": ids,
        "aux_hidden": rng.normal(size=(B, T, 3, CFG.hidden_size)).astype(np.float32),
        "last_hidden": rng.normal(size=(B, T, CFG.hidden_size)).astype(np.float32),
        "anchors": anchors,
        "labels": anchors_lib.block_labels(ids, anchors),
        "predecessors": anchors_lib.markov_predecessors(ids, anchors),
        "eval_mask": anchors_lib.eval_mask(mask, anchors, keep),
    }


def _run(mesh, batch):
    graphdef, params, rest = nnx.split(DSparkDraft(CFG, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = jax.device_put(params, sharding.state_shardings(params, mesh))
    rest = jax.device_put(rest, NamedSharding(mesh, PartitionSpec()))
    keys = jax.random.split(jax.random.key(1))
    frozen = FrozenTarget(
        jax.random.normal(keys[0], (CFG.vocab_size, CFG.hidden_size)),
        jax.random.normal(keys[1], (CFG.hidden_size, CFG.vocab_size)),
    )
    frozen = jax.device_put(frozen, NamedSharding(mesh, PartitionSpec()))
    weight = step_lib.global_weight([batch["eval_mask"]])
    step = jax.jit(functools.partial(step_lib.micro_step, graphdef=graphdef))
    grads, sums = step(params, rest, frozen, to_global(batch, mesh), weight)
    return jax.device_get(grads), float(objective.loss_from_sums(sums)), grads


def test_one_device_equals_eight_sharded_devices(mesh1, mesh8):
    batch = _batch()
    grads1, loss1, _ = _run(mesh1, batch)
    grads8, loss8, sharded = _run(mesh8, batch)
    kernel = sharded["layers"][0]["mlp"]["gate"]["kernel"].get_value()
    assert not kernel.sharding.is_fully_replicated  # fsdp/tensor sharded, batch over data x fsdp
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    flat1, flat8 = nnx.to_flat_state(grads1), dict(nnx.to_flat_state(grads8))
    for path, value in flat1:
        np.testing.assert_allclose(
            np.asarray(flat8[path].get_value()),
            np.asarray(value.get_value()),
            rtol=2e-4,
            atol=2e-6,
            err_msg=str(path),
        )


def test_global_weight_matches_objective_position_weights():
    batch = _batch()
    halves = [batch["eval_mask"][:4], batch["eval_mask"][4:]]
    np.testing.assert_allclose(
        step_lib.global_weight(halves),
        float(jnp.sum(objective.position_weights(jnp.asarray(batch["eval_mask"])))),
        rtol=1e-6,
    )
