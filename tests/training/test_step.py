"""The update step: loss normalised on device, invariant to the device count and to micro-batching; a
group with frozen parameters differentiates only its trainable ones, with the full-gradient step's result."""

import dataclasses
import functools

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import groups, sharding
from dspark_jax.data import batch as batch_lib
from dspark_jax.data.pipeline import to_global
from dspark_jax.draft import objective
from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
from dspark_jax.groups.reranker.model import RerankerDraft, RerankerDraftConfig
from dspark_jax.run.optimizer import make_optimizer
from dspark_jax.training import step as step_lib
from tests import rules

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
BASELINE = groups.get("baseline")


def _batch():
    host = batch_lib.synthetic(
        B, batch_lib.Dims(T, CFG.num_aux, CFG.hidden_size, N), CFG.vocab_size, prompt_length=6
    )
    # Shorter rows: some blocks run past the response end and some rows have padding blocks.
    host["loss_mask"][::3, 12:] = 0
    return batch_lib.device_fields(host)


def _setup(mesh, draft=None):
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0)) if draft is None else draft
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    params = jax.device_put(params, sharding.state_shardings(params, mesh, rules.ALL_GROUPS))
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
        lambda p: objective.loss_from_sums(
            BASELINE.model.train_sums(nnx.merge(graphdef, p, rest), frozen, batch)
        )
    )(params)
    _assert_grads_close(jax.device_get(direct), whole, rtol=1e-4)


FROZEN_GROUP = groups.get("reranker_frozen")


def _full_gradient_micro_step(params, rest, frozen, batch, *, graphdef):
    """The reference: the frozen group's micro-step differentiating every parameter, frozen ones included."""

    def numerators(p):
        sums = FROZEN_GROUP.model.train_sums(nnx.merge(graphdef, p, rest), frozen, batch)
        return objective.loss_numerators(sums, FROZEN_GROUP.model.loss_terms), sums

    group_numerators, pullback, sums = jax.vjp(numerators, params, has_aux=True)
    groups = group_numerators.shape[0]
    grads = tuple(pullback(jax.nn.one_hot(g, groups, dtype=group_numerators.dtype))[0] for g in range(groups))
    return grads, sums


def _full_gradient_update(params, opt_state, group_grads, sums, *, optimizer):
    grads = step_lib.normalised_grads(group_grads, sums, FROZEN_GROUP)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads


def _bits(state):
    return {path: np.asarray(v.get_value()).tobytes() for path, v in nnx.to_flat_state(state)}


def _assert_close_states(a, b):
    """Every leaf of two equally structured pytrees equal within 1e-4 of the leaf's largest magnitude.

    Scaled by the leaf, not by each element: Adam divides a first moment by the root of a second, so an
    element whose gradients nearly cancel across steps turns float32 rounding into a relative error of
    1e-5 or more (JAX 0.12: 2.8e-7 absolute, 7.9e-6 of its leaf's largest element). A wrong gradient moves
    a parameter by a whole learning-rate step, 1e-2 here, and its moments by their own size."""
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        y = np.asarray(y)
        np.testing.assert_allclose(np.asarray(x), y, rtol=0, atol=1e-4 * np.abs(y).max(initial=0.0))


def test_frozen_group_differentiates_only_the_reranker_with_the_full_gradient_result(mesh1):
    """Three optimizer steps of two micro-batches each: the step that differentiates only the reranker
    gives bitwise the parameters and optimizer state, and the metrics, of the one that differentiates
    everything and lets the masked optimizer zero the frozen updates; the logged norm is the reranker's
    gradient's (the full step's also counted the frozen gradients)."""
    cfg = RerankerDraftConfig(
        **dataclasses.asdict(CFG), rerank_candidates=8, rerank_width=16, rerank_heads=4, rerank_ffn=32
    )
    graphdef, params, rest, frozen = _setup(mesh1, RerankerDraft(cfg, rngs=nnx.Rngs(0)))
    optimizer = make_optimizer(1e-2, trainable_mask=FROZEN_GROUP.model.trainable(params))
    batch = _batch()
    micro_batches = [
        to_global({k: v[i * 4 : (i + 1) * 4] for k, v in batch.items()}, mesh1) for i in range(2)
    ]

    micro = jax.jit(functools.partial(step_lib.micro_step, graphdef=graphdef, experiment=FROZEN_GROUP))
    update = jax.jit(functools.partial(step_lib.apply_step, optimizer=optimizer, experiment=FROZEN_GROUP))
    full_micro = jax.jit(functools.partial(_full_gradient_micro_step, graphdef=graphdef))
    full_update = jax.jit(functools.partial(_full_gradient_update, optimizer=optimizer))
    metrics = jax.jit(FROZEN_GROUP.model.metrics)

    new = full = (params, optimizer.init(params))
    reranker_leaves = jax.tree.leaves(params["reranker"])
    start_bits = _bits(params)
    for _ in range(3):
        grads, sums = step_lib.accumulate(*(micro(new[0], rest, frozen, b) for b in micro_batches))
        for g in grads:  # no gradient (nor accumulator) for the frozen leaves
            assert len(jax.tree.leaves(g)) == len(jax.tree.leaves(g["reranker"])) == len(reranker_leaves)
        *new, norm = update(*new, grads, sums)
        full_grads, full_sums = step_lib.accumulate(
            *(full_micro(full[0], rest, frozen, b) for b in micro_batches)
        )
        *full, every_grad = full_update(*full, full_grads, full_sums)

        # The frozen leaves are bitwise their start in both. The reranker's gradients come from two
        # different programs (one differentiates it alone, one everything), whose fusions may round a
        # reduction otherwise (seen on JAX 0.12): equal to float32 rounding after Adam, not bitwise.
        new_bits, full_bits = _bits(new[0]), _bits(full[0])
        frozen_paths = [path for path in new_bits if path[0] != "reranker"]
        assert frozen_paths and all(new_bits[p] == full_bits[p] == start_bits[p] for p in frozen_paths)
        _assert_close_states(new[0], full[0])
        _assert_close_states(new[1], full[1])
        # The metric sums come from the same forward compiled in other fusions, so a reduction may round
        # otherwise: within an ulp in a smoke training run, whose parameters stay bitwise equal.
        new_metrics, full_metrics = jax.device_get((metrics(sums), metrics(full_sums)))
        assert new_metrics.keys() == full_metrics.keys()
        for name, value in full_metrics.items():
            np.testing.assert_allclose(new_metrics[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(norm, optax.global_norm(every_grad["reranker"]), rtol=1e-6)
        assert optax.global_norm(every_grad) > norm  # the full step did compute the frozen gradients
    start = dict(nnx.to_flat_state(params))
    moved = {
        p[0] for p, v in nnx.to_flat_state(new[0]) if not np.array_equal(v.get_value(), start[p].get_value())
    }
    assert moved == {"reranker"}
