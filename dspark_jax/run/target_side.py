"""What a run needs of the target: its shape, frozen embedding and LM head, identity, pad and EOS ids (the
full target only when a cache must be built), the group's side inputs, the draft vocabulary, and the
train/val caches, built first when missing."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax import groups, sharding
from dspark_jax.cache import read_manifest
from dspark_jax.cache.reader import CacheDataSource
from dspark_jax.draft.model import FrozenTarget, make_draft_vocab
from dspark_jax.errors import UsageError
from dspark_jax.inference import vocabulary
from dspark_jax.run import caches, config_lib, draft_state, online
from dspark_jax.target import Target, TargetConfig, eos_ids, target_from_config
from dspark_jax.target.checkpoint import default_target_path, load_checkpoint
from dspark_jax.target.load import TensorReader, abstract_model, tensor_reader
from dspark_jax.target.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TargetSide:
    """What training needs of the target: its shape, frozen matrices and identity."""

    config: TargetConfig
    frozen: FrozenTarget
    fingerprint: str
    tokenizer_fingerprint: str
    pad_id: int
    eos_ids: tuple[int, ...]
    features: online.OnlineFeatures | None = None  # online training: the step's target forward


def device_memory_bytes(mesh: Mesh) -> int | None:
    """One of this process's devices' memory as its runtime reports it (`bytes_limit`); None where it
    reports none (CPU)."""
    stats = mesh.local_devices[0].memory_stats() or {}
    return stats.get("bytes_limit")


def check_online_fits(config, target: TargetConfig, mesh: Mesh) -> None:
    """Online training holds the whole frozen target next to the draft's state on every device: refuses,
    naming the bytes and the mesh axes that would shard them, when one device's share cannot fit. Shapes
    only: runs before any weight is read or any step compiled."""
    limit = device_memory_bytes(mesh)
    if limit is None:
        return
    rules = config_lib.sharding_rules(config)
    dtypes = jnp.dtype(config.target.param_dtype), jnp.dtype(config.target.dtype)
    target_bytes = sharding.device_bytes(
        sharding.with_shardings(nnx.state(abstract_model(target, *dtypes)), mesh, rules)
    )
    _, params, _ = draft_state.abstract_draft(config, target)
    # The draft's parameters, its two Adam moments and the gradient accumulators.
    draft_bytes = 4 * sharding.device_bytes(sharding.with_shardings(params, mesh, rules))
    if target_bytes + draft_bytes <= limit:
        return
    shape = ", ".join(f"mesh.{axis}={size}" for axis, size in mesh.shape.items())
    raise UsageError(
        f"data.features=online: one device needs {(target_bytes + draft_bytes) / 1e9:.2f} GB for the frozen "
        f"target ({target_bytes / 1e9:.2f} GB) and the draft's state ({draft_bytes / 1e9:.2f} GB) before "
        f"any activation, but has {limit / 1e9:.2f} GB ({shape}): shard the target over more devices "
        "(a larger mesh.fsdp, or mesh.tensor), or train offline (data.features=offline)"
    )


def with_online_target(config, side: TargetSide, target: Target) -> TargetSide:
    """`side` with the whole frozen target (`frozen.target_state`) and the step's feature pass, for online
    training (`run.online`)."""
    frozen = side.frozen._replace(target_state=nnx.state(target.model))
    return dataclasses.replace(side, frozen=frozen, features=online.online_features(config, target.model))


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
        target.eos_ids,
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
        eos_ids(ckpt.config, tokenizer),
    )


def load_run_target(config, mesh: Mesh) -> Target:
    """The whole target of a run config, placed on `mesh` by the run's sharding rules."""
    return target_from_config(
        config.target, seed=config.seed, mesh=mesh, rules=config_lib.sharding_rules(config)
    )


def target_reader(config, load_target: Callable[[], Target]) -> TensorReader:
    """`read(path, shape)` of the run's target tensors by model variable path: a checkpoint's tensors read
    one by one (nothing else loaded), a random target's (`target.random_init`) from `load_target()`."""
    if config.target.random_init:
        flat = functools.cache(lambda: dict(nnx.to_flat_state(nnx.state(load_target().model))))
        return lambda path, shape: np.asarray(flat()[path].get_value())
    path = default_target_path() if not config.target.path else config.target.path
    return tensor_reader(load_checkpoint(path))


def _cache_complete(path: str) -> bool:
    try:
        return bool(read_manifest(path).get("complete"))
    except (FileNotFoundError, ValueError):
        return False


def prepare_target_side(config, mesh: Mesh) -> tuple[TargetSide, dict[str, str]]:
    """The target side and the train/val cache paths, building missing caches first.

    The caches built are of the config's kind (`caches.cache_path`): the target's states, or with
    `data.features = "online"` token rows. `data.train_cache` / `data.val_cache` name existing caches to
    use as they are (an online run reads the token rows of a cache of states too; `sources.open_source`).
    """
    if config.preset == "paper" and not config.target.path:
        raise ValueError(
            "config.target.path is required for the paper preset (the Qwen3.8-Flash-Next weights)"
        )
    target = None
    if config.target.random_init:
        target = load_run_target(config, mesh)
        side = side_from_target(target, mesh)
    else:
        side = side_from_checkpoint(config, mesh)
    given = {"train": config.data.train_cache, "val": config.data.val_cache}
    paths = {split: given[split] or caches.cache_path(config, side.fingerprint, split) for split in given}

    def load_target() -> Target:
        nonlocal target
        target = target or load_run_target(config, mesh)
        return target

    draft_state.target_layer_ids(config, side.config)  # refused before the caches, not after
    draft_state.context_aux_index(config)
    config_lib.check_aux_layers(config, side.config.num_layers)
    online_run = not config_lib.reads_states(config)
    if online_run:
        check_online_fits(config, side.config, mesh)
    side = with_side_inputs(config, side, load_target)  # before the caches: its errors are cheap to find
    if online_run:
        side = with_online_target(config, side, load_target())
    for split, path in paths.items():
        if not given[split] and not _cache_complete(path):
            log.info("%s cache %s is missing or incomplete: building it", split, path)
            caches.prepare(config, split, load_target(), mesh)
    if size := config.train.get("draft_vocab", 0):
        side = with_draft_vocab(side, training_vocabulary(config, side, size, paths["train"]), mesh)
    return side, paths


def training_vocabulary(config, side: TargetSide, size: int, path: str | None = None) -> np.ndarray:
    """The `size` tokens of the run's training cache's responses used most (ties to the lower id), plus
    the target's EOS ids: the run's draft vocabulary (`inference.vocabulary`), the same for training and
    decoding. Only the training split (`path`, default the run's) is counted, so no evaluation prompt's
    reply shapes it."""
    path = path or config.data.train_cache or caches.cache_path(config, side.fingerprint, "train")
    try:
        source = CacheDataSource(path, read_states=False)
    except FileNotFoundError:
        raise ValueError(
            f"a draft vocabulary ranks the training cache's tokens, and {path} is not there: build it "
            "(python -m dspark_jax.build_cache with the run's config) or set train.draft_vocab=0 and "
            "generate.draft_vocab=0"
        ) from None
    counts_V = source.token_counts(side.config.vocab_size)
    ids_K = vocabulary.most_frequent(counts_V, size, always=side.eos_ids)
    log.info(
        "draft vocabulary: %d tokens covering %.2f%% of the training responses' tokens (%s)",
        len(ids_K),
        100 * vocabulary.coverage(counts_V, ids_K),
        path,
    )
    return ids_K


def with_draft_vocab(side: TargetSide, ids_K: np.ndarray, mesh: Mesh) -> TargetSide:
    """`side` whose draft logits cover the token ids `ids_K` only (`FrozenTarget.draft_vocab`): the ids
    replicated, their LM-head columns placed as the head is."""
    head_HxV = side.frozen.lm_head_HxV
    spec = sharding.logical_to_spec(("embed", "vocab"), (head_HxV.shape[0], len(ids_K)), mesh)
    vocab = make_draft_vocab(head_HxV, ids_K, NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, spec))
    frozen = side.frozen._replace(draft_vocab=vocab)
    return dataclasses.replace(side, frozen=frozen)


def with_side_inputs(config, side: TargetSide, load_target: Callable[[], Target] | None = None) -> TargetSide:
    """`side` with the side inputs of the config's group on device (`Experiment.run.side_inputs`, made for
    this target; `load_target()` loads the full target where one must be built, None where nothing may be);
    the same `side` for a group without any."""
    make = groups.get(config.experiment).run.side_inputs
    if make is None:
        return side
    inputs = make(
        config,
        fingerprint=side.fingerprint,
        tokenizer_fingerprint=side.tokenizer_fingerprint,
        vocab_size=side.config.vocab_size,
        load_target=load_target,
    )
    return dataclasses.replace(side, frozen=side.frozen._replace(side_inputs=dict(inputs)))
