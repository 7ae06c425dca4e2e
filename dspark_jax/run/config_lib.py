"""Run configs beyond `configs/`: validation, the copy stored with every checkpoint, and comparing two.

Every CLI validates its config before any expensive work (`validate`). Training stores the
whole config in each checkpoint's metadata; `evaluate` and `speculate` given a work directory
use that stored config (`stored_config`), and a `--config` that disagrees with it on a key that
shapes the draft's parameters is refused naming the key (`check_same_shape`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jax.sharding import Mesh
from ml_collections import config_dict

from dspark_jax import groups, sharding
from dspark_jax.data import conversations
from dspark_jax.data.batch import FEATURES, Dims
from dspark_jax.errors import UsageError
from dspark_jax.interop import consumers
from dspark_jax.kernels.block_attention import DEFAULT_BLOCK_SIZES, IMPLEMENTATIONS
from dspark_jax.run import online

log = logging.getLogger(__name__)


# The repository: `configs/` (the experiment files import `configs.base`) and the git provenance of runs.
REPO_ROOT = Path(__file__).resolve().parents[2]

# Config keys that hold paths: made absolute at the command line, so a stored config means the same
# files whatever directory a later command runs in.
PATH_KEYS = (
    ("data", "cache_dir"),
    ("data", "train_cache"),
    ("data", "val_cache"),
    ("target", "path"),
    ("init", "checkpoint"),
)
# Conversation sources: names, files or blends of them (`data.conversations.load_conversations`); the
# files they name are made absolute, names and weights kept.
SOURCE_KEYS = (("data", "train_source"), ("data", "val_source"))


def with_absolute_paths(config):
    """`config` with its path keys and the files its sources name resolved against the working directory
    (URLs unchanged)."""
    if config is None:
        return None
    for keys, resolve in (
        ((*PATH_KEYS, *_group_keys(config, "path_keys")), resolve_path),
        ((*SOURCE_KEYS, *_group_keys(config, "source_keys")), resolve_source),
    ):
        for section, key in keys:
            if section in config and key in config[section]:
                config[section][key] = resolve(config[section][key])
    return config


def resolve_source(spec: str) -> str:
    """A command-line conversation source with the files it names made absolute (`resolve_path`)."""
    return conversations.absolute_source(spec, resolve_path)


def resolve_path(path: str) -> str:
    """A command-line path made absolute against the working directory (URLs stay as they are)."""
    return path if not path or "://" in path else str(Path(path).expanduser().resolve())


def _group_keys(config, field: str) -> tuple:
    """The `field` entries of the config's group's `Run` (`shape_keys`, `resumable_keys`, `path_keys`,
    `source_keys`, `sharding_rules`); none for a group that is not registered (`validate` names it)."""
    experiment = groups.find(_as_dict(config).get("experiment", ""))
    return getattr(experiment.run, field) if experiment else ()


def sharding_rules(config) -> sharding.Rules:
    """The run's logical-axis rules, the one place they are computed: the config's table
    (`sharding.rules`, `sharding.DEFAULT_RULES` where a config has none), plus the group's rules for its own
    logical axes where the table has no entry for them."""
    section = config.get("sharding")
    table = section.get("rules") if section is not None else None
    rules = (
        tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in table)
        if table
        else tuple(sharding.DEFAULT_RULES)
    )
    named = {name for name, _ in rules}
    return rules + tuple(r for r in _group_keys(config, "sharding_rules") if r[0] not in named)


def reads_states(config) -> bool:
    """Whether a run of `config` reads the target's states from its cache (`data.features = "offline"`,
    the default of configs stored before the key) rather than computing them in the step ("online")."""
    features = config.data.get("features", "offline")
    if features not in FEATURES:
        raise ValueError(f"data.features must be one of {FEATURES}, got {features!r}")
    return features == "offline"


def batch_dims(config, hidden_size: int) -> Dims:
    """The batch sizes of a run of `config` for a target of width `hidden_size`."""
    return Dims(
        max_length=config.data.max_length,
        num_aux=len(config.data.aux_layer_ids),
        hidden_size=hidden_size,
        num_anchors=config.train.num_anchors,
        states=reads_states(config),
    )


# Keys whose values fix the base draft's parameter tree (names, shapes) or which target it reads; a group
# adds its own (`Experiment.run.shape_keys`).
SHAPE_KEYS = (
    "experiment",
    "draft.num_layers",
    "draft.num_heads",
    "draft.num_kv_heads",
    "draft.head_dim",
    "draft.intermediate_size",
    "draft.block_size",
    "draft.markov_rank",
    "draft.mask_token_id",
    "data.aux_layer_ids",
    "target.path",
    "target.random_init",
    "target.arch",
)

# Keys a resumed run may change: where it stops, how it logs and saves, how the same math is laid out; a
# group adds its own (`Experiment.run.resumable_keys`).
RESUMABLE_KEYS = (
    "train.stop_step",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.ablate_every_eval",
    "train.checkpoint_every",
    "train.max_to_keep",
    "data.cache_dir",
    "mesh",
    "sharding",
    "draft.attention",
    "draft.attention_block_q",
    "draft.attention_block_k",
    "draft.anchor_chunk",
    "draft.remat",
    "target.name",
)


def validate(config) -> None:
    """Fails early, naming the config key, on settings that cannot work together."""
    try:
        experiment = groups.get(config.experiment)
    except ValueError as e:
        raise UsageError(str(e)) from None
    draft_class = experiment.model.config_class
    settable = {f.name for f in dataclasses.fields(draft_class)} - set(draft_class.TARGET_FIELDS)
    for key in config.draft:
        if key not in settable:
            raise UsageError(
                f"draft.{key} is not a draft setting of {config.experiment!r}; known: {sorted(settable)}"
            )
    t = config.train
    if t.global_batch % t.grad_accum:
        raise UsageError(
            f"train.global_batch={t.global_batch} is not divisible by train.grad_accum={t.grad_accum}"
        )
    if not 0 < t.stop_step <= t.total_steps:
        raise UsageError(f"train.stop_step={t.stop_step} must be in [1, train.total_steps={t.total_steps}]")
    if len(config.data.aux_layer_ids) < 1:
        raise UsageError("data.aux_layer_ids must name at least one target layer")
    _check_aux_layers(config)
    d = config.data
    if d.get("features", "offline") not in FEATURES:
        raise UsageError(f"data.features={d.features!r} must be one of {FEATURES}")
    if d.get("online_dtype", "bfloat16") not in online.ONLINE_DTYPES:
        raise UsageError(f"data.online_dtype={d.online_dtype!r} must be one of {online.ONLINE_DTYPES}")
    chunks, micro_rows = d.get("online_chunks", 1), t.global_batch // t.grad_accum
    if not isinstance(chunks, int) or chunks < 1 or micro_rows % chunks:
        raise UsageError(
            f"data.online_chunks={chunks!r} must be an integer >= 1 that divides the micro-batch's "
            f"{micro_rows} rows (train.global_batch / train.grad_accum)"
        )
    for key in (
        "max_length",
        "num_shards",
        "regen_max_new_tokens",
        "regen_max_prompt_tokens",
        "regen_batch_size",
        "regen_chunk_size",
    ):
        if d.get(key, 1) < 1:
            raise UsageError(f"data.{key}={d[key]} must be >= 1")
    if not isinstance(d.regen_max_turns, int) or d.regen_max_turns < 1:
        raise UsageError(f"data.regen_max_turns={d.regen_max_turns!r} must be an integer >= 1")
    for key in ("num_anchors", "global_batch", "grad_accum", "total_steps"):
        if t[key] < 1:
            raise UsageError(f"train.{key}={t[key]} must be >= 1")
    _check_draft_vocab(config)
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "block_size", "anchor_chunk"):
        if config.draft[key] < 1:
            raise UsageError(f"draft.{key}={config.draft[key]} must be >= 1")
    if config.draft.num_heads % config.draft.num_kv_heads:
        raise UsageError(
            f"draft.num_heads={config.draft.num_heads} is not a multiple of "
            f"draft.num_kv_heads={config.draft.num_kv_heads}"
        )
    if config.draft.attention not in IMPLEMENTATIONS:
        raise UsageError(f"draft.attention={config.draft.attention!r} must be one of {IMPLEMENTATIONS}")
    _check_block_sizes(config.draft)
    if experiment.run.check_config is not None:
        experiment.run.check_config(config)
    if config.draft.block_size != 7:
        log.warning("draft.block_size=%d differs from DSpark's 7", config.draft.block_size)


def _check_draft_vocab(config) -> None:
    """`train.draft_vocab` / `generate.draft_vocab` are token counts within the target's vocabulary (where
    `target.arch` describes it: the embedded default's, a random target's or the paper's shape)."""
    arch, target = config.target.get("arch"), config.target
    vocab = None if arch is None or (target.path and not target.random_init) else arch.vocab_size
    for section in ("train", "generate"):
        size = config[section].get("draft_vocab", 0)
        if not isinstance(size, int) or size < 0 or (vocab is not None and size > vocab):
            limit = f"0..{vocab}" if vocab is not None else ">= 0"
            raise UsageError(
                f"{section}.draft_vocab={size!r} must be an integer in {limit}: the draft's vocabulary "
                "size (0 = the target's whole vocabulary)"
            )


def _check_aux_layers(config) -> None:
    """The aux layer ids name layers of the target that `target.arch` describes: the one built at random
    (`target.random_init`), or with no `target.path` the embedded default's or the paper's shape (what the
    shape-only tools compile). A checkpoint at `target.path` is checked against its own depth when read
    (`check_aux_layers`, before any cache is built)."""
    target = config.target
    arch = target.get("arch")
    if arch is None or (target.path and not target.random_init):
        return
    check_aux_layers(config, arch.num_layers)


def check_aux_layers(config, depth: int) -> None:
    """`data.aux_layer_ids` name layers -1 (embedding output) .. `depth - 1` of a target `depth` layers deep,
    and not its last layer, which SGLang, sglang-jax, DeepSpec, SpecForge and speculators cannot read
    (`Consumer.last_layer`), unless
    `data.tap_last_layer` allows it (then, or for a run stored before the key existed, a warning)."""
    ids = tuple(config.data.aux_layer_ids)
    bad = [i for i in ids if not -1 <= i < depth]
    if bad:
        raise UsageError(
            f"data.aux_layer_ids={ids} names layer {bad[0]}, but the target has {depth} decoder layers: "
            f"use ids -1 (embedding output) .. {depth - 2} (its last layer {depth - 1} no engine serves)"
        )
    if depth - 1 not in ids:
        return
    why = f"its output is read by vLLM alone ({consumers.last_layer_readers()})"
    allowed = config.data.get("tap_last_layer")  # None: stored before the key (a trained run, read again)
    if allowed is False:
        inner = tuple(i - (ids[-1] - depth + 2) for i in ids)
        raise UsageError(
            f"data.aux_layer_ids={ids} taps the target's last layer {depth - 1}: {why}; tap inner layers "
            f'(e.g. --config.data.aux_layer_ids="{inner}"), or set data.tap_last_layer=True to train a '
            "draft that no engine serves"
        )
    log.warning("data.aux_layer_ids=%s taps the target's last layer %d: %s", ids, depth - 1, why)


def _check_block_sizes(draft) -> None:
    """The Pallas kernel's tiles: positive integers; where the kernel may compile ('pallas', 'auto'),
    whole TPU sublane tiles (8 rows) of queries (`block_q * block_size`) and of context keys."""
    block_q = draft.get("attention_block_q", DEFAULT_BLOCK_SIZES.block_q)  # runs stored before the keys
    block_k = draft.get("attention_block_k", DEFAULT_BLOCK_SIZES.block_k)
    for key, value in (("attention_block_q", block_q), ("attention_block_k", block_k)):
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"draft.{key}={value!r} must be an integer >= 1")
    if draft.attention not in ("pallas", "auto"):
        return
    if block_q * draft.block_size % 8:
        raise UsageError(
            f"draft.attention_block_q={block_q} x draft.block_size={draft.block_size} query rows per tile "
            "must be a multiple of 8 (the TPU kernel's sublane tile)"
        )
    if block_k % 8:
        raise UsageError(
            f"draft.attention_block_k={block_k} must be a multiple of 8 (the TPU kernel's sublane tile)"
        )


def get_key(config, key: str, default: Any = None) -> Any:
    """The value of a dotted key (`'draft.block_size'`), or `default` where the config lacks it."""
    node = config
    for part in key.split("."):
        if part not in node:
            return default
        node = node[part]
    return node


def set_key(config, key: str, value: Any) -> None:
    """Sets an existing dotted key of a locked config."""
    *sections, last = key.split(".")
    node = config
    for part in sections:
        node = node[part]
    with config.unlocked():
        node[last] = value


def to_stored(config) -> dict[str, Any]:
    """The config as plain JSON data, for checkpoint metadata."""
    return _jsonable(config.to_dict())


def from_stored(data: Mapping[str, Any]) -> config_dict.ConfigDict:
    """A locked ConfigDict from stored JSON data (lists back to tuples, as the presets write them)."""
    config = config_dict.ConfigDict(_tuples(dict(data)))
    config.lock()
    return config


def train_seed(config) -> int:
    """The seed of the draft's initialisation and of the training data order: `train.seed`, else `seed`
    (a config stored before `train.seed` existed has the latter only)."""
    seed = config.train.get("seed")
    return config.seed if seed is None else seed


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """What the training loop reads of a run config, resolved once (`loop_spec`)."""

    mesh: Mesh
    rules: sharding.Rules
    global_batch: int  # rows per optimizer step, all devices and micro-batches
    grad_accum: int  # micro-batches per optimizer step
    stop_step: int
    log_every: int
    eval_every: int  # 0: only at `stop_step`
    eval_batches: int  # 0: the whole validation cache
    ablate_every_eval: bool
    checkpoint_every: int
    max_to_keep: int
    seed: int  # the validation batches' order
    train_seed: int  # the draft's initialisation and the training data order

    @property
    def micro_rows(self) -> int:
        return self.global_batch // self.grad_accum


def loop_spec(config) -> LoopSpec:
    """The training loop's settings of a run config, its mesh built and its sharding rules resolved."""
    t = config.train
    return LoopSpec(
        mesh=sharding.make_mesh(config.mesh.to_dict()),
        rules=sharding_rules(config),
        global_batch=t.global_batch,
        grad_accum=t.grad_accum,
        stop_step=t.stop_step,
        log_every=t.log_every,
        eval_every=t.eval_every,
        eval_batches=t.eval_batches,
        ablate_every_eval=t.get("ablate_every_eval", False),  # absent from configs stored before it
        checkpoint_every=t.checkpoint_every,
        max_to_keep=t.max_to_keep,
        seed=config.seed,
        train_seed=train_seed(config),
    )


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{'draft.num_heads': 8, ...}`; lists and tuples compare equal."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping | config_dict.ConfigDict):
            out |= flatten(dict(value), f"{name}.")
        else:
            out[name] = _jsonable(value)
    return out


def differing_keys(a, b, keys: tuple[str, ...]) -> list[str]:
    """The keys among `keys` (or below them) whose values differ between configs `a` and `b`."""
    flat_a, flat_b = flatten(_as_dict(a)), flatten(_as_dict(b))
    chosen = lambda name: any(name == k or name.startswith(f"{k}.") for k in keys)
    names = sorted(n for n in set(flat_a) | set(flat_b) if chosen(n))
    return [n for n in names if flat_a.get(n) != flat_b.get(n)]


def check_same_shape(given, stored, where: str) -> None:
    """Refuses a `given` config that disagrees with the `stored` one on a shape-bearing key."""
    stored_random = _as_dict(stored).get("target", {}).get("random_init")
    keys = (*SHAPE_KEYS, *_group_keys(given, "shape_keys"), *_group_keys(stored, "shape_keys"))
    keys = keys if stored_random else tuple(k for k in keys if k != "target.arch")
    diff = differing_keys(given, stored, keys)
    if diff:
        key = diff[0]
        raise UsageError(
            f"--config disagrees with the config stored in {where} on {key}: "
            f"given {flatten(_as_dict(given)).get(key)!r}, stored {flatten(_as_dict(stored)).get(key)!r} "
            f"(drop --config to use the stored one)"
        )


def resume_conflicts(given, stored, allowed: Sequence[str] = ()) -> list[str]:
    """Keys where a resumed run's `given` config differs from the `stored` one and may not."""
    ok = (*RESUMABLE_KEYS, *_group_keys(stored, "resumable_keys"), *allowed)
    flat_given, flat_stored = flatten(_as_dict(given)), flatten(_as_dict(stored))
    changed = sorted(n for n in set(flat_given) | set(flat_stored) if flat_given.get(n) != flat_stored.get(n))
    return [n for n in changed if not any(n == k or n.startswith(f"{k}.") for k in ok)]


def _as_dict(config) -> dict[str, Any]:
    return config.to_dict() if isinstance(config, config_dict.ConfigDict) else dict(config)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping | config_dict.ConfigDict):
        return {k: _jsonable(v) for k, v in dict(value).items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _tuples(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
