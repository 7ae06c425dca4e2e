"""Teacher-forced evaluation of a draft on a validation cache (`eval/tau_prob`, `accept_rate_i`, ...).

Besides the summed metrics, an evaluation keeps per validation sample the sums its tau_prob and accept
rates are ratios of (`intervals.SampleSums`: the unit an interval resamples; every evaluation logs
tau_prob's 95% interval), and can measure a draft on the prefixes another group picks
(`Experiment.model.prefixes`, e.g. Draft Memory's stage-2 anchors), so that groups are compared on the same
prefixes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from dspark_jax import groups, sharding
from dspark_jax.data.batch import device_fields
from dspark_jax.data.pipeline import make_iterator, to_global
from dspark_jax.draft import objective
from dspark_jax.groups import Experiment
from dspark_jax.run import config_lib, draft_state, sources, target_side
from dspark_jax.target import TargetConfig
from dspark_jax.training import intervals
from dspark_jax.training import step as step_lib
from dspark_jax.training.intervals import SampleSums


def make_eval_sums(
    graphdef: nnx.GraphDef,
    experiment: Experiment,
    features: step_lib.Features | None = None,
    ablate: bool = True,
) -> Callable:
    """Jitted `(params, rest, frozen, batch) -> {variant: (sums, block records)}` of the experiment's
    evaluation (`measured_variants`: as trained and, with `ablate`, without each of its
    `evaluation_ablations`); `features` (online training) first adds the target's states to the batch."""

    def sums(params, rest, frozen, batch):
        batch = batch if features is None else features(frozen, batch)
        return measured_variants(experiment, nnx.merge(graphdef, params, rest), frozen, batch, ablate=ablate)

    return jax.jit(sums)


def sample_keys(batch: Mapping[str, np.ndarray], index: int) -> np.ndarray:
    """Each block's sample key `[rows, N, 3]`: (micro-batch index, row, the sample's first index in the
    row), from a host batch's anchors and positions."""
    anchors_BxN = np.asarray(batch["anchors"])
    rows_BxN = np.broadcast_to(np.arange(anchors_BxN.shape[0])[:, None], anchors_BxN.shape)
    starts_BxN = anchors_BxN - np.take_along_axis(np.asarray(batch["positions"]), anchors_BxN, axis=1)
    return np.stack([np.full_like(anchors_BxN, index), rows_BxN, starts_BxN], axis=-1)


def _host_records(
    records: Mapping[str, jax.Array], batch: Mapping[str, jax.Array], index: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A micro-batch's block records on the host, every process's rows (`process_allgather`: a record of
    another process's rows cannot be fetched), and their `sample_keys` from the global batch's anchors and
    positions, so that keys and records name the same global rows."""
    fields = {"anchors": batch["anchors"], "positions": batch["positions"]}
    host = multihost_utils.process_allgather({**records, **fields}, tiled=True)
    return {k: np.asarray(host[k]) for k in records}, sample_keys(host, index)


class _Collected:
    """The summed sums (on the device they come from), block records and sample keys of one variant over
    validation micro-batches."""

    def __init__(self):
        self.total, self.records, self.keys = None, [], []

    def add(self, sums, records: dict[str, np.ndarray], keys: np.ndarray) -> None:
        self.total = sums if self.total is None else jax.tree.map(lambda a, b: a + b, self.total, sums)
        self.records.append(records)
        self.keys.append(keys)

    def finish(self, experiment: Experiment) -> tuple[dict[str, float], SampleSums]:
        """Metrics of the summed sums and the per-sample sums of the collected block records."""
        if self.total is None:
            raise ValueError(
                "the validation cache yields no batch; it needs at least one micro-batch of samples"
            )
        metrics = {k: float(x) for k, x in jax.device_get(experiment.model.metrics(self.total)).items()}
        joined = {k: np.concatenate([r[k] for r in self.records]) for k in ("figure_overlap", "eval_mask")}
        return metrics, intervals.sample_sums(joined, np.concatenate(self.keys))


def ablation_metrics(
    experiment: Experiment, samples: SampleSums, ablated: Mapping[str, tuple[dict, SampleSums]]
) -> dict[str, float]:
    """Per ablation `name`: `tau_prob_without_<name>` and `<name>_gain` (tau_prob minus it, paired over
    the same samples and blocks) with its interval `<name>_gain_low95` / `_high95` (none for an evaluation
    without ablations)."""
    out = {}
    for ablation in experiment.report.evaluation_ablations:
        if ablation.name not in ablated:
            continue
        metrics, without = ablated[ablation.name]
        out[f"tau_prob_without_{ablation.name}"] = metrics["tau_prob"]
        if len(samples.tau_K) > 1:
            gain = intervals.paired_difference(
                samples.tau_K, samples.blocks_K, without.tau_K, without.blocks_K
            )
            out |= {
                f"{ablation.name}_gain": gain.estimate,
                f"{ablation.name}_gain_low95": gain.low,
                f"{ablation.name}_gain_high95": gain.high,
            }
    return out


def _finish_variants(
    experiment: Experiment, collected: Mapping[str, _Collected]
) -> tuple[dict[str, float], SampleSums, dict[str, SampleSums]]:
    """The metrics as trained (with each ablation's figures), its per-sample sums and each ablation's."""
    if not collected:
        _Collected().finish(experiment)  # the one-line error of an empty validation cache
    finished = {name: c.finish(experiment) for name, c in collected.items()}
    metrics, samples = finished.pop(AS_TRAINED)
    ablated = {name: sums for name, (_, sums) in finished.items()}
    return metrics | ablation_metrics(experiment, samples, finished), samples, ablated


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
    """Metrics over validation batches (all of them when `max_batches` is 0), summed globally, with
    `tau_prob_low95` / `tau_prob_high95`: its interval over the validation samples (`intervals.ratio`),
    and each ablation's figures (`ablation_metrics`)."""
    collected: dict[str, _Collected] = {}
    for index, batch in enumerate(batches):
        if max_batches and index >= max_batches:
            break
        global_batch = to_global(device_fields(batch), mesh, rules)
        for name, (sums, records) in eval_sums(params, rest, frozen, global_batch).items():
            collected.setdefault(name, _Collected()).add(sums, *_host_records(records, global_batch, index))
    metrics, samples, _ = _finish_variants(experiment, collected)
    if len(samples.tau_K) > 1:  # a single validation sample has no interval
        tau = intervals.ratio(samples.tau_K, samples.blocks_K)
        metrics |= {"tau_prob_low95": tau.low, "tau_prob_high95": tau.high}
    return metrics


class Validation(NamedTuple):
    """A trained draft with what evaluating it on the validation cache of its config needs (`epoch()` gives
    the same micro-batches each call)."""

    config: object
    experiment: Experiment
    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    step: int
    target: TargetConfig
    frozen: object
    features: step_lib.Features | None  # online training: the target forward before each step
    samples: int
    epoch: Callable[[], Iterator[Mapping[str, np.ndarray]]]  # a new pass over the micro-batches, each call
    mesh: Mesh
    rules: sharding.Rules


def open_validation(config, checkpoint: str | os.PathLike) -> Validation:
    """Restores the draft of `checkpoint` and opens one epoch of its config's validation cache."""
    mesh = sharding.make_mesh(config.mesh.to_dict())
    side, paths = target_side.prepare_target_side(config, mesh)
    source = sources.open_source(paths["val"], config, side)
    graphdef, params, rest, step = draft_state.restore_draft(config, side.config, mesh, checkpoint)
    micro_rows = config.train.global_batch // config.train.grad_accum
    pipeline = sources.pipeline_config(config, side, batch_size=micro_rows, seed=config.seed, num_epochs=1)
    experiment = groups.get(config.experiment)
    return Validation(
        config,
        experiment,
        graphdef,
        params,
        rest,
        step,
        side.config,
        side.frozen,
        side.features,
        len(source),
        lambda: make_iterator(source, pipeline),
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
            v.epoch(),
            v.mesh,
            0,
            v.rules,
        )
    return {"step": v.step, "samples": v.samples, **metrics}


class Prefixes(NamedTuple):
    """A trained draft of a group that picks its own prefixes (`Experiment.model.prefixes`): the source of the
    blocks other drafts are measured on, picked per validation batch."""

    experiment: Experiment
    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    step: int


# What fixes the validation batches (and so each block's sample and uniform anchor): two drafts measured on
# the same prefixes must agree on all of it.
SAME_BATCH_KEYS = ("seed", "data", "target", "train.global_batch", "train.grad_accum")


def open_prefixes(v: Validation, config, checkpoint: str | os.PathLike) -> Prefixes:
    """The draft of `checkpoint` (a run of `config`) as the source of the prefixes `v` is measured on, or a
    one-line error: its group picks no prefixes or reads side inputs, `v`'s group picks other prefixes, or
    the two configs would give other validation batches."""
    experiment = groups.get(config.experiment)
    if experiment.model.prefixes is None:
        pickers = [e.name for e in groups.registered() if e.model.prefixes is not None]
        raise config_lib.UsageError(
            f"{checkpoint} is a {config.experiment!r} run, a group without prefixes of its own; give a "
            f"checkpoint of one of {pickers}"
        )
    if experiment.run.side_inputs is not None:
        raise config_lib.UsageError(f"group {config.experiment!r} reads side inputs: it cannot pick prefixes")
    if v.experiment.model.prefixes is not None and v.experiment.name != experiment.name:
        raise config_lib.UsageError(
            f"group {v.experiment.name!r} picks its own prefixes; it cannot be measured on "
            f"{experiment.name!r}'s"
        )
    if diff := config_lib.differing_keys(v.config, config, SAME_BATCH_KEYS):
        raise config_lib.UsageError(
            f"{checkpoint} was trained with another {diff[0]} than the draft measured on its prefixes; their "
            "validation batches differ (a suite's groups share them)"
        )
    graphdef, params, rest, step = draft_state.restore_draft(config, v.target, v.mesh, checkpoint)
    return Prefixes(experiment, graphdef, params, rest, step)


def evaluation_with_records(
    experiment: Experiment,
    model: nnx.Module,
    frozen,
    batch: Mapping[str, jax.Array],
    prefixes: tuple[Experiment, nnx.Module] | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """`(sums, records)`: the experiment's evaluation sums and per-block records
    (`objective.recording_blocks`) of `model` on the batch's anchors, or on the prefixes that
    `prefixes = (group, its draft)` picks (a group that picks its own is measured as it is: `open_prefixes`
    checked that they are that group's)."""
    if prefixes is not None and experiment.model.prefixes is None:
        picker_group, picker = prefixes
        anchors_BxN, keep_BxN = picker_group.model.prefixes(picker, frozen, batch)
        batch = {**batch, "anchors": anchors_BxN, "block_keep": keep_BxN}
    with objective.recording_blocks() as recorded:
        sums = experiment.model.evaluation_sums(model, frozen, batch)
    if len(recorded) != 1:
        raise ValueError(
            f"experiment {experiment.name!r}: its evaluation computes the objective {len(recorded)} "
            "times; block records need exactly one"
        )
    return sums, {k: x.astype(jnp.float32) for k, x in recorded[0].items()}


# The variant key of the draft as trained, beside its ablations' names.
AS_TRAINED = ""


def measured_variants(experiment: Experiment, model, frozen, batch, prefixes=None, ablate=True) -> dict:
    """`{AS_TRAINED: (sums, records)}` of `evaluation_with_records` (the same arguments), and with `ablate`
    the same for each of the experiment's `report.evaluation_ablations` by name (the same blocks, one input
    removed)."""
    out = {AS_TRAINED: evaluation_with_records(experiment, model, frozen, batch, prefixes)}
    for ablation in experiment.report.evaluation_ablations if ablate else ():
        ablated = {**batch, ablation.flag: True}
        out[ablation.name] = evaluation_with_records(experiment, model, frozen, ablated, prefixes)
    return out


def _records_fn(v: Validation, prefixes: Prefixes | None, ablate: bool) -> Callable:
    """Jitted `(params, rest, prefix_params, prefix_rest, frozen, batch) -> {variant: (sums, records)}` of
    `measured_variants` (online training: the target's states first)."""

    def run(params, rest, prefix_params, prefix_rest, frozen, batch):
        batch = batch if v.features is None else v.features(frozen, batch)
        picker = None
        if prefixes is not None:
            picker = (prefixes.experiment, nnx.merge(prefixes.graphdef, prefix_params, prefix_rest))
        model = nnx.merge(v.graphdef, params, rest)
        return measured_variants(v.experiment, model, frozen, batch, picker, ablate)

    return jax.jit(run)


def _measured_batches(
    v: Validation, prefixes: Prefixes | None, ablate: bool
) -> Iterator[dict[str, tuple[dict, dict[str, np.ndarray], np.ndarray]]]:
    """Per validation micro-batch: `{variant: (sums, block records [rows, N, S])}` on the host, with the
    records' `sample_keys`."""
    fn = _records_fn(v, prefixes, ablate)
    prefix_state = (None, None) if prefixes is None else (prefixes.params, prefixes.rest)
    with sharding.activation_sharding(v.mesh, v.rules):
        for index, batch in enumerate(v.epoch()):
            global_batch = to_global(device_fields(batch), v.mesh, v.rules)
            variants = fn(v.params, v.rest, *prefix_state, v.frozen, global_batch)
            yield {
                name: (jax.device_get(sums), *_host_records(records, global_batch, index))
                for name, (sums, records) in variants.items()
            }


def block_records(v: Validation, prefixes: Prefixes | None = None) -> list[dict[str, np.ndarray]]:
    """Per validation micro-batch, the teacher-forced per-block records of `objective.recording_blocks`
    (`[rows, N, S]` arrays) of the experiment's own evaluation forward (on `prefixes`' blocks if given)."""
    return [variants[AS_TRAINED][1] for variants in _measured_batches(v, prefixes, ablate=False)]


def measure_checkpoint(
    v: Validation, prefixes: Prefixes | None = None
) -> tuple[dict[str, float], SampleSums, dict[str, SampleSums]]:
    """One pass over `v`'s validation batches: the metrics (as `evaluate`, on `prefixes`' blocks if given,
    with each ablation's figures), the per-sample sums of tau_prob and the accept rates, and each ablation's
    per-sample sums by name."""
    collected: dict[str, _Collected] = {}
    for variants in _measured_batches(v, prefixes, ablate=True):
        for name, measured in variants.items():
            collected.setdefault(name, _Collected()).add(*measured)
    return _finish_variants(v.experiment, collected)
