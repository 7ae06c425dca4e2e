"""From a config to the pieces of a run: the frozen target side, caches, draft and pipeline.

Training never holds the whole target: the draft needs only the target's embedding and LM
head (`FrozenTarget`) and the identity that the caches must match. The full target is
loaded only when a cache is missing and has to be built first.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dspark_jax import sharding
from dspark_jax.cache import CacheDataSource, read_manifest
from dspark_jax.cache.build import cache_path, prepare_split
from dspark_jax.data.pipeline import PipelineConfig
from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
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
    """The target side and the train/val cache paths, building missing caches first."""
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
    paths = {split: cache_path(config, side.fingerprint, split) for split in ("train", "val")}
    for split, path in paths.items():
        if not _cache_complete(path):
            log.info("%s cache %s is missing or incomplete: building it", split, path)
            target = target or target_from_config(config.target, seed=config.seed, mesh=mesh)
            prepare_split(config, split, target, mesh)
    return side, paths


def open_source(path: str, config, side: TargetSide) -> CacheDataSource:
    """A cache as a grain source, validated against the config and the target."""
    expect = {
        "aux_layer_ids": tuple(config.data.aux_layer_ids),
        "hidden_size": side.config.hidden_size,
        "tokenizer_fingerprint": side.tokenizer_fingerprint,
        "target_fingerprint": side.fingerprint,
    }
    return CacheDataSource(path, expect=expect)


def draft_config(config, target: TargetConfig) -> DraftConfig:
    d = config.draft
    return DraftConfig(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_aux=len(config.data.aux_layer_ids),
        num_layers=d.num_layers,
        num_heads=d.num_heads,
        num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim,
        intermediate_size=d.intermediate_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        block_size=d.block_size,
        markov_rank=d.markov_rank,
        mask_token_id=None if d.mask_token_id < 0 else d.mask_token_id,
        attention=d.attention,
        anchor_chunk=d.anchor_chunk,
    )


def init_draft(config, target: TargetConfig, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)` of a freshly initialised draft, params sharded on `mesh`."""
    model = DSparkDraft(
        draft_config(config, target),
        rngs=nnx.Rngs(config.seed),
        param_dtype=jnp.dtype(config.draft.param_dtype),
        dtype=jnp.dtype(config.draft.dtype),
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, sharding.state_shardings(params, mesh))
    return graphdef, params, jax.device_put(rest, NamedSharding(mesh, jax.sharding.PartitionSpec()))


def pipeline_config(
    config, side: TargetSide, *, batch_size: int, seed: int, num_epochs: int | None
) -> PipelineConfig:
    return PipelineConfig(
        max_length=config.data.max_length,
        num_anchors=config.train.num_anchors,
        batch_size=batch_size,
        seed=seed,
        pad_id=side.pad_id,
        block_size=config.draft.block_size,
        num_epochs=num_epochs,
        worker_count=config.data.worker_count,
    )


def make_training_optimizer(config) -> tuple[optax.Schedule, optax.GradientTransformation]:
    t = config.train
    schedule = make_schedule(t.peak_lr, t.total_steps, t.warmup_fraction)
    return schedule, make_optimizer(
        schedule, weight_decay=t.weight_decay, clip_norm=t.clip_norm, b1=t.b1, b2=t.b2, eps=t.eps
    )


def abstract_state(state):
    """`ShapeDtypeStruct`s (with shardings) shaped like `state`, for orbax restores."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


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


def restore_draft(config, target: TargetConfig, mesh: Mesh, checkpoint: str | os.PathLike):
    """`(graphdef, params, rest, step)` of a trained draft restored from `checkpoint`."""
    graphdef, params, rest = init_draft(config, target, mesh)
    _, optimizer = make_training_optimizer(config)
    directory, step = resolve_checkpoint(checkpoint)
    state = {"params": params, "opt_state": jax.jit(optimizer.init)(params)}
    with Checkpointer(directory) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        state, _ = checkpointer.restore(step, abstract_state(state))
    return graphdef, state["params"], rest, step
