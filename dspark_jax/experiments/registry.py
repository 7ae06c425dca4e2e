"""The one place where experiment groups differ: a registry from `config.experiment` to an `Experiment`.

Training, evaluation, speculative decoding, the AOT memory check and the benchmarks all ask this
registry for the group's pieces; nothing else branches on the group. A group is composition over
the baseline: its own draft class (a subclass or a new head), its own per-micro-batch sums (one
forward or Draft Memory's two stages), its own loss terms and metrics, its own inference proposer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from dspark_jax.draft import objective
from dspark_jax.draft.model import DraftConfig, FrozenTarget
from dspark_jax.inference.engine import DSPARK_PROPOSER, Proposer

Batch = Mapping[str, jax.Array]
SumsFn = Callable[[nnx.Module, FrozenTarget, Batch], dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything that differs per experiment group.

    Attributes:
      name: the `config.experiment` value.
      build_draft: `(cfg, rngs=...) -> draft module` (an `nnx.Module` with `cfg`, `dtype`,
        `context`, `context_kv`, `backbone` and `layers` for inference, e.g. `DSparkDraft`).
      train_sums: the train step's forward on one micro-batch (the fields of `data.batch`):
        `(draft, frozen, batch) -> sums`; the step differentiates the loss numerators of these
        sums, so a two-stage group puts its stop-gradient stage 1 inside.
      eval_sums: the same for teacher-forced evaluation; None = `train_sums`.
      loss_terms: loss groups over the sums (`objective.LossTerms`), each divided on device by
        its own globally summed denominator.
      metrics: globally summed sums -> scalar metrics (logged as train/... and eval/...).
      proposer: how the draft makes a block at inference (`inference.engine.Proposer`).
      config_class: the draft config built from the config's whole `draft` section.
      trainable: params -> pytree of bools (False = frozen parameter); None = all trainable.
      init_from: the group whose checkpoint (`config.init.checkpoint`, at `config.init.step`) a new run
        starts from: its parameters are restored into the same names (an exact match, checked), the
        rest keep their initialisation; None = from scratch.
    """

    name: str
    build_draft: Callable[..., nnx.Module]
    train_sums: SumsFn
    eval_sums: SumsFn | None = None
    loss_terms: objective.LossTerms = dataclasses.field(default_factory=lambda: objective.DSPARK_LOSS)
    metrics: Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]] = objective.metrics_from_sums
    proposer: Proposer = DSPARK_PROPOSER
    config_class: type[DraftConfig] = DraftConfig
    trainable: Callable[[Any], Any] | None = None
    init_from: str | None = None

    @property
    def evaluation_sums(self) -> SumsFn:
        return self.eval_sums or self.train_sums


_REGISTRY: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    """Adds a group; its name must be new."""
    if experiment.name in _REGISTRY:
        raise ValueError(f"experiment group {experiment.name!r} is already registered")
    _REGISTRY[experiment.name] = experiment
    return experiment


def get(name: str) -> Experiment:
    """The group a config's `experiment` key names."""
    if name not in _REGISTRY:
        raise ValueError(f"config.experiment={name!r} is not a registered group; choose one of {names()}")
    return _REGISTRY[name]


def names() -> list[str]:
    return sorted(_REGISTRY)
