"""Teacher-forced evaluation of a draft on a validation cache (`eval/tau_prob`, `accept_rate_i`, ...)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax import experiments, sharding
from dspark_jax.data.batch import device_fields
from dspark_jax.data.pipeline import make_iterator, to_global
from dspark_jax.experiments import Experiment
from dspark_jax.train import components
from dspark_jax.train import step as step_lib


def make_eval_sums(graphdef: nnx.GraphDef, experiment: Experiment) -> Callable:
    """Jitted `(params, rest, frozen, batch) -> sums` of the experiment's evaluation."""
    return jax.jit(lambda p, r, f, b: experiment.evaluation_sums(nnx.merge(graphdef, p, r), f, b))


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


def evaluate_checkpoint(config, checkpoint: str | os.PathLike) -> dict[str, float]:
    """Metrics of a trained draft on the whole validation cache of `config`."""
    mesh = sharding.make_mesh(config.mesh.to_dict())
    rules = sharding.rules_of(config)
    experiment = experiments.get(config.experiment)
    side, paths = components.prepare_target_side(config, mesh)
    source = components.open_source(paths["val"], config, side)
    graphdef, params, rest, step = components.restore_draft(config, side.config, mesh, checkpoint)
    micro_rows = config.train.global_batch // config.train.grad_accum
    batches = make_iterator(
        source,
        components.pipeline_config(config, side, batch_size=micro_rows, seed=config.seed, num_epochs=1),
    )
    with sharding.activation_sharding(mesh, rules):
        metrics = evaluate(
            make_eval_sums(graphdef, experiment),
            experiment,
            params,
            rest,
            side.frozen,
            batches,
            mesh,
            0,
            rules,
        )
    return {"step": step, "samples": len(source), **metrics}
