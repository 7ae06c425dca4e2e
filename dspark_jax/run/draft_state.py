"""The draft of a run: its config from the `draft` section, abstract shapes, a fresh initialisation straight
into its shardings, a warm start from another group's run (`Experiment.model.init_from`) and a restore from a
checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dspark_jax import groups, sharding
from dspark_jax.run import checkpoints, config_lib
from dspark_jax.run.checkpoints import Checkpointer
from dspark_jax.target import TargetConfig
from dspark_jax.target.load import TensorReader, abstract_model

log = logging.getLogger(__name__)


def draft_config(config, target: TargetConfig):
    """The draft config of `config`: its whole `draft` section plus what the target fixes."""
    cls = groups.get(config.experiment).model.config_class
    return cls.from_config(config.draft, target, num_aux=len(config.data.aux_layer_ids))


def abstract_draft(config, target: TargetConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)` of the config's draft as `ShapeDtypeStruct`s (nothing allocated)."""
    build = groups.get(config.experiment).model.build_draft
    cfg = draft_config(config, target)
    seed = config_lib.train_seed(config)
    return nnx.split(nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(seed))), nnx.Param, ...)


def _build_state(config, target: TargetConfig, mesh: Mesh, *, with_params: bool):
    """`(params, rest)` (params None unless `with_params`) of a new draft, initialised under `jit` straight
    into their shardings (no full host copy at paper shapes; unused parts are never computed)."""
    build = groups.get(config.experiment).model.build_draft
    cfg = draft_config(config, target)
    _, abstract_params, abstract_rest = abstract_draft(config, target)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    param_shardings = sharding.state_shardings(abstract_params, mesh, config_lib.sharding_rules(config))
    out_shardings = (
        param_shardings if with_params else None,
        jax.tree.map(lambda _: replicated, abstract_rest),
    )

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def init():
        _, params, rest = nnx.split(build(cfg, rngs=nnx.Rngs(config_lib.train_seed(config))), nnx.Param, ...)
        return (params if with_params else None), rest

    return init()


def init_draft(
    config, target: TargetConfig, mesh: Mesh, read_target: TensorReader | None = None
) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)` of a freshly initialised draft, params sharded on `mesh`; with
    `init.from_target_layers`, its layers start from those of the target that `read_target` reads."""
    graphdef = abstract_draft(config, target)[0]
    params, rest = _build_state(config, target, mesh, with_params=True)
    context_aux_index(config)  # refused without target layers to copy
    if target_layer_ids(config, target):
        if read_target is None:
            raise ValueError("init.from_target_layers needs the target's tensors (read_target)")
        params = from_target_layers(config, target, params, read_target)
    return graphdef, params, rest


def random_init(config):
    """A copy of `config` whose draft starts from a random init (no `init.from_target_layers`, no
    `init.context_from_aux`): the same shapes, for tools that time or test them without the target's
    tensors."""
    config = config.copy_and_resolve_references()
    if "init" in config:
        with config.unlocked():
            config.init.from_target_layers = None
            config.init.context_from_aux = None
    return config


def target_layer_ids(config, target: TargetConfig) -> tuple[int, ...]:
    """`init.from_target_layers` as non-negative target layer ids, one per draft layer, checked before any
    work (empty: a random init). Only a dense full-attention layer has the draft layer's tensors."""
    ids = config.get("init", {}).get("from_target_layers")  # absent from configs stored before it
    if not ids:
        return ()
    ids, n = tuple(int(i) for i in ids), target.num_layers
    if len(ids) != config.draft.num_layers:
        raise config_lib.UsageError(
            f"init.from_target_layers={ids} names {len(ids)} target layers; the draft has "
            f"draft.num_layers={config.draft.num_layers}: name one per draft layer"
        )
    bad = [i for i in ids if not -n <= i < n]
    if bad:
        raise config_lib.UsageError(f"init.from_target_layers: layer {bad[0]} is not among the target's {n}")
    ids = tuple(i % n for i in ids)
    types = target.layer_types or ("full_attention",) * n
    for i in ids:
        if types[i] != "full_attention" or target.num_experts:
            kind = "experts" if target.num_experts else types[i]
            raise config_lib.UsageError(
                f"init.from_target_layers: target layer {i} is a {kind} layer; a draft layer starts from a "
                "dense full-attention one"
            )
    return ids


def from_target_layers(
    config, target: TargetConfig, params: nnx.State, read_target: TensorReader
) -> nnx.State:
    """`params` with draft layer k's norms, attention projections and MLP read from target layer
    `init.from_target_layers[k]` (`read_target(path, shape)` takes the target model's variable paths). A
    draft tensor the target's layer lacks (q/k norms of a Llama target) keeps its init; a shape that differs
    is refused with the draft keys to set."""
    ids = target_layer_ids(config, target)
    target_paths = _target_layer_paths(target)
    copied, placed = set(), []
    for path, var in nnx.to_flat_state(params):
        sub = tuple(path[2:])
        if path[0] != "layers" or sub not in target_paths:
            placed.append((path, var))
            continue
        value = var.get_value()
        if target_paths[sub] != tuple(value.shape):
            raise config_lib.UsageError(
                f"init.from_target_layers: draft {'.'.join(map(str, sub))} is {tuple(value.shape)}, the "
                f"target's {target_paths[sub]}: set draft.num_heads={target.num_heads}, "
                f"num_kv_heads={target.num_kv_heads}, head_dim={target.head_dim}, "
                f"intermediate_size={target.intermediate_size}"
            )
        source = np.asarray(read_target(("layers", ids[path[1]], *sub), tuple(value.shape)))
        placed.append((path, var.replace(jax.device_put(source.astype(value.dtype), value.sharding))))
        copied.add(".".join(map(str, sub)))
    log.info("draft layers start from target layers %s: %s", ids, ", ".join(sorted(copied)))
    aux = context_aux_index(config)
    if aux is not None:
        placed = _context_pass_through(placed, aux, target.hidden_size, ids[0], read_target)
        log.info(
            "the context starts as aux layer %d (target layer %d's output) under layer %d's input norm",
            aux,
            config.data.aux_layer_ids[aux],
            ids[0],
        )
    return nnx.from_flat_state(placed)


def _target_layer_paths(target: TargetConfig) -> dict[tuple, tuple[int, ...]]:
    """A target layer's variable paths (below `layers.k`) and shapes: what a draft layer can start from."""
    return {
        tuple(path[2:]): tuple(var.get_value().shape)
        for path, var in nnx.to_flat_state(nnx.state(abstract_model(target)))
        if path[0] == "layers" and path[1] == 0
    }


def copied_mask(config, target: TargetConfig) -> Callable[[Any], Any] | None:
    """The parameters `from_target_layers` starts from the target's (the draft layers' tensors a target
    layer has, and `aux_proj` / `aux_norm` with `init.context_from_aux`) as a mask function of the draft's
    parameters, for `train.copied_lr_scale`; None without `init.from_target_layers`."""
    if not config.get("init", {}).get("from_target_layers"):
        return None
    target_paths = _target_layer_paths(target)
    context = (
        {("aux_proj", "kernel"), ("aux_norm", "scale")} if context_aux_index(config) is not None else set()
    )

    def copied(path) -> bool:
        keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)
        keys = keys[:-1] if keys[-1] == "value" else keys  # an nnx.Variable's value leaf
        return (keys[0] == "layers" and keys[2:] in target_paths) or keys in context

    return lambda params: jax.tree_util.tree_map_with_path(lambda path, _: copied(path), params)


def context_aux_index(config) -> int | None:
    """`init.context_from_aux` as a non-negative index into `data.aux_layer_ids` (None: a random context
    projection), checked before any work: it needs `init.from_target_layers`."""
    index = config.get("init", {}).get("context_from_aux")  # absent from configs stored before it
    if index is None:
        return None
    a = len(config.data.aux_layer_ids)
    if not config.init.get("from_target_layers"):
        raise config_lib.UsageError(
            f"init.context_from_aux={index} starts the context as the input of the first copied target "
            "layer: set init.from_target_layers too"
        )
    if not -a <= index < a:
        raise config_lib.UsageError(
            f"init.context_from_aux={index}: data.aux_layer_ids has {a} layers (index -{a}..{a - 1})"
        )
    return index % a


def _context_pass_through(placed: list, aux: int, hidden: int, layer: int, read_target: TensorReader) -> list:
    """`placed` (flat draft parameters) with the context `aux_norm(aux_proj(...))` starting as target layer
    `layer`'s input norm of aux layer `aux`: `aux_proj` the identity on that layer's block (zero elsewhere),
    `aux_norm` that norm's scale. The copied layer then reads the context as the target's reads its input."""
    out = []
    for path, var in placed:
        value = var.get_value()
        if path == ("aux_proj", "kernel"):
            source = np.zeros(value.shape, np.float32)
            source[aux * hidden : (aux + 1) * hidden] = np.eye(hidden)
        elif path == ("aux_norm", "scale"):
            source = np.asarray(read_target(("layers", layer, "input_norm", "scale"), tuple(value.shape)))
        else:
            out.append((path, var))
            continue
        out.append((path, var.replace(jax.device_put(source.astype(value.dtype), value.sharding))))
    return out


def init_source(config) -> tuple[epath.Path, int] | None:
    """`(checkpoints directory, step)` a run of an `init_from` group starts from, checked before any work:
    it exists, holds that step, and was trained by that group with the same shapes. None for other groups."""
    source_group = groups.get(config.experiment).model.init_from
    if source_group is None:
        return None
    init = config.init
    if not init.checkpoint:
        raise config_lib.UsageError(
            f"config.init.checkpoint is empty: {config.experiment} starts from a {source_group} run "
            f"(train one with python -m dspark_jax.train --config=configs/{source_group}.py)"
        )
    try:
        directory, _ = checkpoints.resolve_checkpoint(init.checkpoint)
        stored = checkpoints.run_config(init.checkpoint)
    except FileNotFoundError as e:
        raise config_lib.UsageError(f"config.init.checkpoint: {e}") from None
    if stored.experiment != source_group:
        raise config_lib.UsageError(
            f"config.init.checkpoint {init.checkpoint} is a {stored.experiment!r} run; "
            f"{config.experiment} starts from a {source_group!r} one"
        )
    config_lib.check_same_shape(
        _as_group(config, source_group), stored, f"config.init.checkpoint {directory}"
    )
    with Checkpointer(directory) as checkpointer:
        if init.step not in checkpointer.all_steps():
            raise config_lib.UsageError(
                f"config.init.step={init.step}: {directory} holds steps {checkpointer.all_steps()}"
            )
    return directory, init.step


def _as_group(config, group: str):
    """`config` as the `group` run it starts from: that experiment, its draft settings only."""
    names = {f.name for f in dataclasses.fields(groups.get(group).model.config_class)}
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
    _, abstract, _ = abstract_draft(_as_group(config, groups.get(config.experiment).model.init_from), target)
    abstract = sharding.with_shardings(abstract, mesh, config_lib.sharding_rules(config))
    with Checkpointer(directory) as checkpointer:
        restored = checkpointer.restore_params(step, abstract)
    log.info("warm start: %d parameter groups from %s step %d", len(restored), directory, step)
    return nnx.State({**dict(params), **dict(restored)})


def abstract_state(state, mesh: Mesh):
    """`ShapeDtypeStruct`s (with shardings) shaped like `state`, for orbax restores. A leaf not laid out on
    `mesh` (the optimizer's step count, placed on one device by `optimizer.init`) is restored replicated
    over the mesh: on one device it would belong to one process only, and a multi-process step refuses it."""
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def one(x):
        sharding = x.sharding if isinstance(x.sharding, NamedSharding) else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, state)


def restore_draft(config, target: TargetConfig, mesh: Mesh, checkpoint: str | os.PathLike):
    """`(graphdef, params, rest, step)` of a trained draft; reads only the parameters (no optimizer state)."""
    graphdef, abstract_params, _ = abstract_draft(config, target)
    abstract_params = sharding.with_shardings(abstract_params, mesh, config_lib.sharding_rules(config))
    _, rest = _build_state(config, target, mesh, with_params=False)
    directory, _ = checkpoints.resolve_checkpoint(checkpoint)
    step = checkpoints.checkpoint_step(checkpoint)
    with Checkpointer(directory) as checkpointer:
        params = checkpointer.restore_params(step, abstract_params)
    return graphdef, params, rest, step
