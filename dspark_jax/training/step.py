"""The update step as pure functions over NNX state, split for gradient accumulation.

One optimizer step over a global batch split into micro-batches, all on device:

  for each micro-batch:  group_grads, sums += micro_step(params, ..., micro_batch)
  params, opt_state = apply_step(params, opt_state, group_grads, sums)

An experiment group's loss is `sum_g numerator_g / denominator_g` over its loss groups
(`objective.LossTerms`). `micro_step` returns the gradient of each group's *numerator* and the
micro-batch's sums; `apply_step` divides each group's accumulated gradient by that group's
globally summed denominator once, at the end. Because denominators are treated as constants
(they count valid predictions, never a function the loss is meant to move), this equals the
gradient of the globally normalised loss (docs/design.md section 1) whatever the number of devices or
micro-batches, and denominators computed inside the step never go through the host.

A group with frozen parameters (`Experiment.model.trainable`) is differentiated only with respect to its
trainable ones: the frozen ones are closed over as constants, so no backward pass runs through them
(e.g. a frozen backbone under a new head), and the gradients and their accumulator hold only the trainable
leaves (None in place of the frozen ones, the parameters' own tree otherwise). The optimizer
(`optimizer.make_optimizer(trainable_mask=...)`) gives the frozen leaves zero updates and holds no state
for them; `apply_step` hands it zeros in their place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dspark_jax import sharding
from dspark_jax.draft import objective
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.groups import Experiment

Batch = Mapping[str, jax.Array]
# `(frozen, batch) -> batch` with the target's states added (online training: `run.online.OnlineFeatures`).
Features = Callable[[FrozenTarget, Batch], Batch]


def split_trainable(params: nnx.State, experiment: Experiment) -> tuple[nnx.State, nnx.State]:
    """`(trainable, frozen)`: `params` with None in place of its frozen leaves, and with None in place of
    its trainable ones (by the experiment's mask: all trainable without one). `join` undoes it."""
    trainable = experiment.model.trainable
    mask = jax.tree.map(lambda _: True, params) if trainable is None else trainable(params)
    return (
        jax.tree.map(lambda trained, x: x if trained else None, mask, params),
        jax.tree.map(lambda trained, x: None if trained else x, mask, params),
    )


def join(part: Any, other: Any) -> Any:
    """`part` (a `split_trainable` half) with its None leaves taken from `other`, a tree of its structure."""
    return jax.tree.map(lambda a, b: b if a is None else a, part, other, is_leaf=lambda x: x is None)


def micro_step(
    params: nnx.State,
    rest: nnx.State,
    frozen: FrozenTarget,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    experiment: Experiment,
    features: Features | None = None,
) -> tuple[tuple[nnx.State, ...], dict[str, jax.Array]]:
    """Per loss group, the gradient of this micro-batch's loss numerator with respect to the trainable
    parameters (`split_trainable`); and its sums. `features` (online training, `run.online`) first adds
    the target's states to the batch, outside the differentiated function."""
    if features is not None:
        batch = features(frozen, batch)
    trainable, frozen_params = split_trainable(params, experiment)

    def numerators(p):
        sums = experiment.model.train_sums(nnx.merge(graphdef, join(p, frozen_params), rest), frozen, batch)
        return objective.loss_numerators(sums, experiment.model.loss_terms), sums

    group_numerators, pullback, sums = jax.vjp(numerators, trainable, has_aux=True)
    groups = group_numerators.shape[0]
    one_hot = lambda g: jax.nn.one_hot(g, groups, dtype=group_numerators.dtype)
    grads = tuple(sharding.constrain_state(pullback(one_hot(g))[0]) for g in range(groups))
    return grads, sums


def accumulate(total: Any, new: Any) -> Any:
    """Elementwise sum of two pytrees (gradients or sums)."""
    return jax.tree.map(jnp.add, total, new)


def normalised_grads(
    group_grads: tuple[nnx.State, ...], sums: Mapping[str, jax.Array], experiment: Experiment
):
    """The gradient of the globally normalised loss: each group's gradient over its global denominator."""
    group_denominators = objective.loss_denominators(sums, experiment.model.loss_terms)
    scaled = [
        jax.tree.map(lambda g, d=group_denominators[i]: objective.normalise(g, d.astype(g.dtype)), grads)
        for i, grads in enumerate(group_grads)
    ]
    return scaled[0] if len(scaled) == 1 else jax.tree.map(lambda *g: sum(g), *scaled)


def apply_step(
    params: nnx.State,
    opt_state: optax.OptState,
    group_grads: tuple[nnx.State, ...],
    sums: Mapping[str, jax.Array],
    *,
    optimizer: optax.GradientTransformation,
    experiment: Experiment,
) -> tuple[nnx.State, optax.OptState, jax.Array]:
    """One optimizer update from accumulated numerator gradients (of the trainable parameters) and sums;
    returns the new params, optimizer state and the pre-clip norm of the trainable parameters' gradient."""
    grads = normalised_grads(group_grads, sums, experiment)
    _, frozen_params = split_trainable(params, experiment)
    full_grads = join(grads, jax.tree.map(jnp.zeros_like, frozen_params))
    updates, opt_state = optimizer.update(full_grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.global_norm(grads)
