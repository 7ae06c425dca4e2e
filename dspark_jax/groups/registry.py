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
class DecodeOption:
    """A flag of `python -m dspark_jax.speculate` that a group adds: `--<flag>=<choice>` sets the config key
    `key` of a checkpoint of that group before decoding (refused for a checkpoint of any other group)."""

    flag: str
    key: str  # a dotted config key, e.g. 'draft.<name>'
    choices: tuple[str, ...]
    help: str


@dataclasses.dataclass(frozen=True)
class Ablation:
    """The same weights evaluated on the same blocks with one of the draft's inputs removed: evaluation sets
    the batch key `flag` to True (a Python bool, inside the jitted evaluation) and the group's forward leaves
    that input out. Evaluation logs `tau_prob_without_<name>` and `<name>_gain` (tau_prob minus it, with its
    paired interval over the validation samples)."""

    name: str
    flag: str


# Every group: the target's context features (each block sees only its own slots, and a group's own extra
# keys such as a memory). A group that picks its blocks in a first pass picks them with the context.
HIDE_CONTEXT = "hide_context"
WITHOUT_CONTEXT = Ablation("context", HIDE_CONTEXT)


@dataclasses.dataclass(frozen=True)
class Design:
    """A group's row of the seed's group table ("initialisation and update scope", "question compared").

    Attributes:
      initialisation: where its parameters start (from scratch, or which checkpoint).
      updates: which parameters the optimizer changes and which loss reaches them.
      adds: what it adds to the baseline draft (the report adds the parameter count).
      question: the question its comparison answers.
    """

    initialisation: str
    updates: str
    adds: str
    question: str


@dataclasses.dataclass(frozen=True)
class Model:
    """A group's draft: how it is built, trained, evaluated and how it drafts at inference.

    Attributes:
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
      prefixes: `(draft, frozen, batch) -> (anchors [B, N], block_keep [B, N])`, for a group whose own figures
        are measured on prefixes it picks itself rather than on the batch's anchors (Draft Memory: the
        stage-2 anchors after its stage-1 draft's first error), block `n` in the sample of the batch's block
        `n`; evaluation then measures every other group on the same prefixes too
        (`training.evaluation.open_prefixes`). None = the batch's anchors.
      prefixes_note: why measuring every group on `prefixes` is the fair comparison (the report prints it).
      init_from: the group whose checkpoint (`config.init.checkpoint`, at `config.init.step`) a new run
        starts from: its parameters are restored into the same names (an exact match, checked), the
        rest keep their initialisation; None = from scratch.
    """

    build_draft: Callable[..., nnx.Module]
    train_sums: SumsFn
    eval_sums: SumsFn | None = None
    loss_terms: objective.LossTerms = dataclasses.field(default_factory=lambda: objective.DSPARK_LOSS)
    metrics: Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]] = objective.metrics_from_sums
    proposer: Proposer = DSPARK_PROPOSER
    config_class: type[DraftConfig] = DraftConfig
    trainable: Callable[[Any], Any] | None = None
    prefixes: Callable[[nnx.Module, FrozenTarget, Batch], tuple[jax.Array, jax.Array]] | None = None
    prefixes_note: str = ""
    init_from: str | None = None

    @property
    def evaluation_sums(self) -> SumsFn:
        return self.eval_sums or self.train_sums


@dataclasses.dataclass(frozen=True)
class Run:
    """What a group adds to a run's config and inputs (shared code knows none of these by name).

    Attributes:
      shape_keys: config keys (or sections) that fix the group's own parameters, beyond the base draft's
        (`run.config_lib.SHAPE_KEYS`); a `--config` or a resumed run that changes one is refused.
      resumable_keys: config keys of the group that a resumed run may change.
      path_keys: `(section, key)` config entries of the group that hold paths (made absolute at the
        command line).
      source_keys: `(section, key)` entries that hold conversation sources (names, files or blends: the
        files they name made absolute at the command line).
      sharding_rules: `(logical axis, mesh axes)` rules for the logical axes of the group's parameters,
        added to the run's table where it has no entry for them.
      check_config: `config -> None`, raising `errors.UsageError` naming the key on settings of the group
        that cannot work (called by `run.config_lib.validate`, before any expensive work).
      side_inputs: `(config, *, fingerprint, tokenizer_fingerprint, vocab_size, load_target) -> {name:
        device pytree}`: frozen inputs the group's draft reads besides the target's matrices
        (`FrozenTarget.side_inputs`), made or loaded for this target; `load_target()` loads the full
        target when one must be built (None where nothing may be built). None = no side inputs.
      synthetic_side_inputs: `(config, vocab_size) -> {name: device pytree}` of `side_inputs`' shapes with
        made-up values, for what needs no fitted input: timing (`benchmarks/train_step.py`) and, through
        `jax.eval_shape`, the ahead-of-time memory check. None with `side_inputs` None.
      decode_options: `DecodeOption`s, the group's own decoding flags (recorded with every result).
      serving_gap: what a serving engine (vLLM, SGLang, TensorRT-LLM: each runs the baseline DSpark draft
        only) would need to run the group's own parameters; `python -m dspark_jax.export` refuses the group
        with it unless asked for the baseline part alone. Empty for a group with no parameter of its own.
    """

    shape_keys: tuple[str, ...] = ()
    resumable_keys: tuple[str, ...] = ()
    path_keys: tuple[tuple[str, str], ...] = ()
    source_keys: tuple[tuple[str, str], ...] = ()
    sharding_rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = ()
    check_config: Callable[[Any], None] | None = None
    side_inputs: Callable[..., Mapping[str, Any]] | None = None
    synthetic_side_inputs: Callable[[Any, int], Mapping[str, Any]] | None = None
    decode_options: tuple[DecodeOption, ...] = ()
    serving_gap: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    """How reports show a group, and what its evaluation removes.

    Attributes:
      label: the display name (default: the group's `name`).
      design: the group's row of the seed's group table (None: not in it).
      suites: the experiment suites (`python -m dspark_jax.experiments --suite=...`) the group belongs to;
        a suite runs its groups in registration order, and a group with `Model.init_from` after that
        group's final checkpoint.
      report_columns: `(metric, column title)` of the group's own `eval/` metrics in a suite's results
        table (blank for the groups without them).
      report_note: one sentence on how to read the group's figures, under the results table.
      ablations: the group's own inputs whose removal evaluation measures (`Ablation`), besides the
        target context every group is measured without (`WITHOUT_CONTEXT`).
    """

    label: str = ""
    design: Design | None = None
    suites: tuple[str, ...] = ()
    report_columns: tuple[tuple[str, str], ...] = ()
    report_note: str = ""
    ablations: tuple[Ablation, ...] = ()

    @property
    def evaluation_ablations(self) -> tuple[Ablation, ...]:
        """What evaluation removes, one input at a time: the target context, then the group's own."""
        return (WITHOUT_CONTEXT, *self.ablations)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything that differs per experiment group.

    Attributes:
      name: the `config.experiment` value.
      model: the draft and its training, evaluation and decoding (`Model`).
      run: what the group adds to a run's config and inputs (`Run`; default: nothing).
      report: how reports show it (`Report`; default: under its name, in no suite).
    """

    name: str
    model: Model
    run: Run = Run()
    report: Report = Report()

    @property
    def display_name(self) -> str:
        return self.report.label or self.name


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


def find(name: str) -> Experiment | None:
    """The group `name`, or None for a name no group has (a config not yet validated)."""
    return _REGISTRY.get(name)


def decode_options() -> dict[str, tuple[DecodeOption, list[str]]]:
    """Every group's decoding flags: `{flag: (option, the groups that have it)}`."""
    out: dict[str, tuple[DecodeOption, list[str]]] = {}
    for name, experiment in sorted(_REGISTRY.items()):
        for option in experiment.run.decode_options:
            out.setdefault(option.flag, (option, []))[1].append(name)
    return out


def registered() -> list[Experiment]:
    """Every group, in registration order."""
    return list(_REGISTRY.values())


def names() -> list[str]:
    return sorted(_REGISTRY)
