"""Teacher-forced evaluation of a draft on a validation cache (`eval/tau_prob`, `accept_rate_i`, ...)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax import groups, sharding
from dspark_jax.data.batch import device_fields
from dspark_jax.data.pipeline import make_iterator, to_global
from dspark_jax.draft import objective
from dspark_jax.groups import Experiment
from dspark_jax.run import config_lib, draft_state, sources, target_side
from dspark_jax.training import step as step_lib


def make_eval_sums(
    graphdef: nnx.GraphDef, experiment: Experiment, features: step_lib.Features | None = None
) -> Callable:
    """Jitted `(params, rest, frozen, batch) -> sums` of the experiment's evaluation; `features` (online
    training) first adds the target's states to the batch."""

    def sums(params, rest, frozen, batch):
        batch = batch if features is None else features(frozen, batch)
        return experiment.evaluation_sums(nnx.merge(graphdef, params, rest), frozen, batch)

    return jax.jit(sums)


def evaluate(
    eval_sums: Callable,
    experiment: Experiment,
    params,
    rest,
    frozen,
    batches: Iterator[Mapping[str, np.ndarray]],
    mesh: Mesh,
    max_batches: int,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> dict[str, float]:
    """Metrics over validation batches (all of them when `max_batches` is 0), summed globally."""
    total = None
    for index, batch in enumerate(batches):
        if max_batches and index >= max_batches:
            break
        sums = eval_sums(params, rest, frozen, to_global(device_fields(batch), mesh, rules))
        total = sums if total is None else step_lib.accumulate(total, sums)
    if total is None:
        raise ValueError("the validation cache yields no batch; it needs at least one micro-batch of samples")
    return {k: float(v) for k, v in jax.device_get(experiment.metrics(total)).items()}


class Validation(NamedTuple):
    """A trained draft with what evaluating it on the validation cache of its config needs."""

    experiment: Experiment
    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    step: int
    frozen: object
    features: step_lib.Features | None  # online training: the target forward before each step
    samples: int
    batches: Iterator[Mapping[str, np.ndarray]]  # one epoch of micro-batches
    mesh: Mesh
    rules: sharding.Rules


def open_validation(config, checkpoint: str | os.PathLike) -> Validation:
    """Restores the draft of `checkpoint` and opens one epoch of its config's validation cache."""
    mesh = sharding.make_mesh(config.mesh.to_dict())
    side, paths = target_side.prepare_target_side(config, mesh)
    source = sources.open_source(paths["val"], config, side)
    graphdef, params, rest, step = draft_state.restore_draft(config, side.config, mesh, checkpoint)
    micro_rows = config.train.global_batch // config.train.grad_accum
    batches = make_iterator(
        source,
        sources.pipeline_config(config, side, batch_size=micro_rows, seed=config.seed, num_epochs=1),
    )
    experiment = groups.get(config.experiment)
    return Validation(
        experiment,
        graphdef,
        params,
        rest,
        step,
        side.frozen,
        side.features,
        len(source),
        batches,
        mesh,
        config_lib.sharding_rules(config),
    )


def evaluate_checkpoint(config, checkpoint: str | os.PathLike) -> dict[str, float]:
    """Metrics of a trained draft on the whole validation cache of `config`."""
    v = open_validation(config, checkpoint)
    with sharding.activation_sharding(v.mesh, v.rules):
        metrics = evaluate(
            make_eval_sums(v.graphdef, v.experiment, v.features),
            v.experiment,
            v.params,
            v.rest,
            v.frozen,
            v.batches,
            v.mesh,
            0,
            v.rules,
        )
    return {"step": v.step, "samples": v.samples, **metrics}


def block_records(v: Validation) -> list[dict[str, np.ndarray]]:
    """Per validation micro-batch, the teacher-forced per-block records of `objective.recording_blocks`
    (`[rows, N, S]` arrays) of the experiment's own evaluation forward."""

    def records(params, rest, frozen, batch):
        batch = batch if v.features is None else v.features(frozen, batch)
        with objective.recording_blocks() as recorded:
            v.experiment.evaluation_sums(nnx.merge(v.graphdef, params, rest), frozen, batch)
        if len(recorded) != 1:
            raise ValueError(
                f"experiment {v.experiment.name!r}: its evaluation computes the objective {len(recorded)} "
                "times; block records need exactly one"
            )
        return {k: x.astype(jnp.float32) for k, x in recorded[0].items()}

    fn = jax.jit(records)
    out = []
    with sharding.activation_sharding(v.mesh, v.rules):
        for batch in v.batches:
            arrays = fn(v.params, v.rest, v.frozen, to_global(device_fields(batch), v.mesh, v.rules))
            out.append({k: np.asarray(x) for k, x in jax.device_get(arrays).items()})
    return out
