"""From a config to the pieces of a run: the frozen target side, caches, draft, optimizer and pipeline.

Training never holds the whole target: the draft needs only the target's embedding and LM
head (`FrozenTarget`) and the identity that the caches must match. The full target is
loaded only when a cache is missing and has to be built first.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dspark_jax import config_lib, experiments, sharding
from dspark_jax.cache import CacheDataSource, DeepSpecDataSource, open_cache, read_manifest
from dspark_jax.cache.build import cache_path, prepare_split
from dspark_jax.data.pipeline import PipelineConfig
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.engram import prepare as engram_prepare
from dspark_jax.inference import calibration
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.target import Target, TargetConfig, target_from_config
from dspark_jax.target.checkpoint import default_target_path, load_checkpoint
from dspark_jax.target.tokenizer import Tokenizer
from dspark_jax.train.checkpoint import Checkpointer
from dspark_jax.train.optimizer import make_optimizer, make_schedule

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TargetSide:
    """What training needs of the target: its shape, frozen matrices and identity."""

    config: TargetConfig
    frozen: FrozenTarget
    fingerprint: str
    tokenizer_fingerprint: str
    pad_id: int


def _place(x: np.ndarray | jax.Array, axes: tuple[str, str], mesh: Mesh, dtype) -> jax.Array:
    spec = sharding.logical_to_spec(axes, np.shape(x), mesh)
    return jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, spec))


def side_from_target(target: Target, mesh: Mesh) -> TargetSide:
    model, dtype = target.model, jnp.dtype(target.model.dtype)
    frozen = FrozenTarget(
        _place(model.embedding.get_value(), ("vocab", "embed"), mesh, dtype),
        _place(model.lm_head_matrix(), ("embed", "vocab"), mesh, dtype),
    )
    tokenizer = target.tokenizer
    return TargetSide(
        target.config,
        frozen,
        target.fingerprint,
        tokenizer.fingerprint(),
        tokenizer.pad_id if tokenizer.pad_id is not None else 0,
    )


def side_from_checkpoint(config, mesh: Mesh) -> TargetSide:
    """Reads only the embedding and LM head of the target checkpoint (plus its tokenizer)."""
    path = default_target_path() if not config.target.path else config.target.path
    ckpt = load_checkpoint(path)
    dtype = jnp.dtype(config.target.dtype)
    lm_name = "model.embed_tokens.weight" if ckpt.config.tie_word_embeddings else "lm_head.weight"
    embedding = ckpt.read("model.embed_tokens.weight")
    frozen = FrozenTarget(
        _place(embedding, ("vocab", "embed"), mesh, dtype),
        _place(ckpt.read(lm_name).T, ("embed", "vocab"), mesh, dtype),
    )
    tokenizer = (
        Tokenizer.from_gguf(path)
        if str(path).endswith(".gguf")
        else Tokenizer.from_tokenizer_json(f"{path}/tokenizer.json")
    )
    return TargetSide(
        ckpt.config,
        frozen,
        ckpt.fingerprint(),
        tokenizer.fingerprint(),
        tokenizer.pad_id if tokenizer.pad_id is not None else 0,
    )


def _cache_complete(path: str) -> bool:
    try:
        return bool(read_manifest(path).get("complete"))
    except (FileNotFoundError, ValueError):
        return False


def prepare_target_side(config, mesh: Mesh) -> tuple[TargetSide, dict[str, str]]:
    """The target side and the train/val cache paths, building missing caches first.

    `data.train_cache` / `data.val_cache` name existing caches to use as they are.
    """
    if config.preset == "paper" and not config.target.path:
        raise ValueError(
            "config.target.path is required for the paper preset (the Qwen3.8-Flash-Next weights)"
        )
    target = None
    if config.target.random_init:
        target = target_from_config(config.target, seed=config.seed, mesh=mesh)
        side = side_from_target(target, mesh)
    else:
        side = side_from_checkpoint(config, mesh)
    given = {"train": config.data.train_cache, "val": config.data.val_cache}
    paths = {split: given[split] or cache_path(config, side.fingerprint, split) for split in given}

    def load_target() -> Target:
        nonlocal target
        target = target or target_from_config(config.target, seed=config.seed, mesh=mesh)
        return target

    if engram_prepare.uses_engram(config):  # the table first: its errors are cheap to find
        side = with_engram(config, side, load_target)
    for split, path in paths.items():
        if not given[split] and not _cache_complete(path):
            log.info("%s cache %s is missing or incomplete: building it", split, path)
            prepare_split(config, split, load_target(), mesh)
    return side, paths


def with_engram(config, side: TargetSide, load_target=None) -> TargetSide:
    """`side` with the config's Engram table on device (`FrozenTarget.engram`), fitted first with
    `load_target()` when missing."""
    table = engram_prepare.prepare_table(
        config, side.fingerprint, side.tokenizer_fingerprint, side.config.vocab_size, load_target
    )
    return dataclasses.replace(side, frozen=side.frozen._replace(engram=table.to_device()))


def open_source(path: str, config, side: TargetSide) -> CacheDataSource | DeepSpecDataSource:
    """A cache (either format) as a grain source, validated against the config and the target."""
    expect = {
        "aux_layer_ids": tuple(config.data.aux_layer_ids),
        "hidden_size": side.config.hidden_size,
        "tokenizer_fingerprint": side.tokenizer_fingerprint,
        "target_fingerprint": side.fingerprint,
    }
    return open_cache(path, expect=expect)


def draft_config(config, target: TargetConfig):
    """The draft config of `config`: its whole `draft` section plus what the target fixes."""
    cls = experiments.get(config.experiment).config_class
    return cls.from_config(config.draft, target, num_aux=len(config.data.aux_layer_ids))


def abstract_draft(config, target: TargetConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)` of the config's draft as `ShapeDtypeStruct`s (nothing allocated)."""
    build = experiments.get(config.experiment).build_draft
    cfg = draft_config(config, target)
    return nnx.split(nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(config.seed))), nnx.Param, ...)


def _build_state(config, target: TargetConfig, mesh: Mesh, *, with_params: bool):
    """`(params, rest)` (params None unless `with_params`) of a new draft, initialised under `jit` straight
    into their shardings (no full host copy at paper shapes; unused parts are never computed)."""
    build = experiments.get(config.experiment).build_draft
    cfg = draft_config(config, target)
    _, abstract_params, abstract_rest = abstract_draft(config, target)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    param_shardings = sharding.state_shardings(abstract_params, mesh, sharding.rules_of(config))
    out_shardings = (
        param_shardings if with_params else None,
        jax.tree.map(lambda _: replicated, abstract_rest),
    )

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def init():
        _, params, rest = nnx.split(build(cfg, rngs=nnx.Rngs(config.seed)), nnx.Param, ...)
        return (params if with_params else None), rest

    return init()


def init_draft(config, target: TargetConfig, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)` of a freshly initialised draft, params sharded on `mesh`."""
    graphdef = abstract_draft(config, target)[0]
    params, rest = _build_state(config, target, mesh, with_params=True)
    return graphdef, params, rest


def init_source(config) -> tuple[epath.Path, int] | None:
    """`(checkpoints directory, step)` a run of an `init_from` group starts from, checked before any work:
    it exists, holds that step, and was trained by that group with the same shapes. None for other groups."""
    experiment = experiments.get(config.experiment)
    if experiment.init_from is None:
        return None
    init = config.init
    if not init.checkpoint:
        raise config_lib.UsageError(
            f"config.init.checkpoint is empty: {config.experiment} starts from a {experiment.init_from} run "
            f"(train one with python -m dspark_jax.train --config=configs/{experiment.init_from}.py)"
        )
    try:
        directory, _ = resolve_checkpoint(init.checkpoint)
        stored = run_config(init.checkpoint)
    except FileNotFoundError as e:
        raise config_lib.UsageError(f"config.init.checkpoint: {e}") from None
    if stored.experiment != experiment.init_from:
        raise config_lib.UsageError(
            f"config.init.checkpoint {init.checkpoint} is a {stored.experiment!r} run; "
            f"{config.experiment} starts from a {experiment.init_from!r} one"
        )
    config_lib.check_same_shape(
        _as_group(config, experiment.init_from), stored, f"config.init.checkpoint {directory}"
    )
    with Checkpointer(directory) as checkpointer:
        if init.step not in checkpointer.all_steps():
            raise config_lib.UsageError(
                f"config.init.step={init.step}: {directory} holds steps {checkpointer.all_steps()}"
            )
    return directory, init.step


def _as_group(config, group: str):
    """`config` as the `group` run it starts from: that experiment, its draft settings only."""
    names = {f.name for f in dataclasses.fields(experiments.get(group).config_class)}
    data = config.to_dict()
    data["experiment"] = group
    data["draft"] = {k: v for k, v in data["draft"].items() if k in names}
    data.pop("init", None)
    return config_lib.from_stored(data)


def warm_start(config, target: TargetConfig, mesh: Mesh, params, source: tuple[epath.Path, int]):
    """`params` with the `init_from` run's parameters restored into their names from `source`
    (`init_source`'s `(directory, step)`; every one of that run's parameters must be there with its
    shape, nothing else is read); the others keep their values."""
    directory, step = source
    _, abstract, _ = abstract_draft(_as_group(config, experiments.get(config.experiment).init_from), target)
    abstract = sharding.with_shardings(abstract, mesh, sharding.rules_of(config))
    with Checkpointer(directory) as checkpointer:
        restored = checkpointer.restore_params(step, abstract)
    log.info("warm start: %d parameter groups from %s step %d", len(restored), directory, step)
    return nnx.State({**dict(params), **dict(restored)})


def pipeline_config(
    config, side: TargetSide, *, batch_size: int, seed: int, num_epochs: int | None
) -> PipelineConfig:
    return PipelineConfig(
        max_length=config.data.max_length,
        num_anchors=config.train.num_anchors,
        batch_size=batch_size,
        seed=seed,
        pad_id=side.pad_id,
        num_epochs=num_epochs,
        worker_count=config.data.worker_count,
        pack=config.data.get("pack", False),  # absent from configs stored before it
    )


def make_training_optimizer(config, params=None) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """The schedule and AdamW of `config.train`; the experiment's frozen parameters (if any) of
    `params` get no update."""
    t = config.train
    trainable = experiments.get(config.experiment).trainable
    schedule = make_schedule(t.peak_lr, t.total_steps, t.warmup_fraction)
    return schedule, make_optimizer(
        schedule,
        weight_decay=t.weight_decay,
        clip_norm=t.clip_norm,
        b1=t.b1,
        b2=t.b2,
        eps=t.eps,
        trainable_mask=None if trainable is None or params is None else trainable(params),
    )


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params, mesh: Mesh):
    """Shardings of `optimizer.init(params)` laid out for FSDP: a leaf shaped like a parameter whose key
    path ends with that parameter's (the Adam moments) takes the parameter's sharding; the rest (step
    counts) is replicated. `params` carry their shardings (arrays or `ShapeDtypeStruct`s)."""
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    by_path = {jax.tree_util.keystr(path): p for path, p in jax.tree_util.tree_leaves_with_path(params)}

    def one(path, x):
        name = jax.tree_util.keystr(path)
        matches = [k for k, p in by_path.items() if name.endswith(k) and p.shape == x.shape]
        return by_path[max(matches, key=len)].sharding if matches else replicated

    return jax.tree_util.tree_map_with_path(one, jax.eval_shape(optimizer.init, params))


def init_optimizer_state(optimizer: optax.GradientTransformation, params, mesh: Mesh):
    """`optimizer.init(params)` placed by `optimizer_state_shardings` (moments sharded like their
    parameters, not whole on one device)."""
    shardings = optimizer_state_shardings(optimizer, params, mesh)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def abstract_state(state, mesh: Mesh):
    """`ShapeDtypeStruct`s (with shardings) shaped like `state`, for orbax restores. A leaf not laid out on
    `mesh` (the optimizer's step count, placed on one device by `optimizer.init`) is restored replicated
    over the mesh: on one device it would belong to one process only, and a multi-process step refuses it."""
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def one(x):
        sharding = x.sharding if isinstance(x.sharding, NamedSharding) else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, state)


def resolve_checkpoint(path: str | os.PathLike) -> tuple[epath.Path, int | None]:
    """`(checkpoints directory, step or None for the latest)` from a work directory, a checkpoints
    directory, or one step's directory."""
    path = epath.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path not found: {path}")
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if path.name.isdigit() and (path / "state").exists():
        return path.parent, int(path.name)
    return path, None


def calibration_file(checkpoint: str | os.PathLike, step: int) -> epath.Path:
    """The STS calibration file of checkpoint `step` of the run that `checkpoint` names (beside its
    checkpoints directory: `<workdir>/calibration/step_<step>/sts.json`)."""
    return calibration.calibration_path(resolve_checkpoint(checkpoint)[0].parent, step)


def load_calibration(
    checkpoint: str | os.PathLike, step: int, block_size: int
) -> dict[str, tuple[float, ...]]:
    """The STS temperatures of every mode for checkpoint `step`; a clear error when it was never fitted."""
    path = calibration_file(checkpoint, step)
    if not path.exists():
        raise config_lib.UsageError(
            f"--schedule=confidence needs the STS calibration of step {step} ({path} is missing): run "
            f"python -m dspark_jax.calibrate --checkpoint={checkpoint} first"
        )
    return {mode: calibration.load_temperatures(path, mode, block_size) for mode in calibration.MODES}


def run_config(checkpoint: str | os.PathLike, given=None):
    """The config a run was trained with, read from its checkpoint metadata.

    With `given` (a `--config`), that config is used instead, after checking that it agrees with
    the stored one on every shape-bearing key.
    """
    directory, step = resolve_checkpoint(checkpoint)
    with Checkpointer(directory) as checkpointer:
        stored = checkpointer.meta(step).get("config")
    where = str(directory)
    if stored is None and given is None:
        raise ValueError(f"checkpoint {where} stores no config (an older run?): pass --config")
    if stored is None:
        return given
    if given is None:
        return config_lib.from_stored(stored)
    config_lib.check_same_shape(given, stored, where)
    return given


def restore_draft(config, target: TargetConfig, mesh: Mesh, checkpoint: str | os.PathLike):
    """`(graphdef, params, rest, step)` of a trained draft; reads only the parameters (no optimizer state)."""
    graphdef, abstract_params, _ = abstract_draft(config, target)
    abstract_params = sharding.with_shardings(abstract_params, mesh, sharding.rules_of(config))
    _, rest = _build_state(config, target, mesh, with_params=False)
    directory, _ = resolve_checkpoint(checkpoint)
    step = checkpoint_step(checkpoint)
    with Checkpointer(directory) as checkpointer:
        params = checkpointer.restore_params(step, abstract_params)
    return graphdef, params, rest, step


def checkpoint_step(checkpoint: str | os.PathLike) -> int:
    """The step `checkpoint` names: the given step's directory, else the latest checkpoint."""
    directory, step = resolve_checkpoint(checkpoint)
    if step is None:
        with Checkpointer(directory) as checkpointer:
            step = checkpointer.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    return step


def speculative_decoder(
    config,
    target: Target,
    draft,
    *,
    batch_size: int,
    mesh: Mesh,
    select_top_k: int | None = None,
    schedule: str = "fixed",
    temperatures: dict[str, tuple[float, ...]] | None = None,
) -> SpeculativeDecoder:
    """The experiment's speculative decoder for a loaded target and a draft `(graphdef, params, rest)`;
    `select_top_k` defaults to the config's `generate.select_top_k`; `schedule` and `temperatures` as in
    `SpeculativeDecoder`."""
    if select_top_k is None:
        select_top_k = config.generate.get("select_top_k", 0)  # absent from configs stored before it
    side = side_from_target(target, mesh)
    if engram_prepare.uses_engram(config):
        side = with_engram(config, side)
    return SpeculativeDecoder(
        target.model,
        *draft,
        side.frozen,
        proposer=experiments.get(config.experiment).proposer,
        aux_layer_ids=config.data.aux_layer_ids,
        eos_ids=target.eos_ids,
        pad_id=target.tokenizer.pad_id,
        batch_size=batch_size,
        mesh=mesh,
        select_top_k=select_top_k,
        schedule=schedule,
        temperatures=temperatures,
    )
