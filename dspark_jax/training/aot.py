"""Ahead-of-time memory check: does one device's share of a program fit, before renting a pod?

  python -m dspark_jax.check_memory --config=configs/baseline.py:paper [--micro_batch=4]
  python -m dspark_jax.check_memory --config=configs/baseline.py:paper --topology=tpu-v5p-8
  python -m dspark_jax.check_memory --config=configs/baseline.py:paper --topology=h200x8 \
      --program=target_forward [--forward_rows=1]

Two programs (`PROGRAMS`), each compiled for abstract inputs (`jax.ShapeDtypeStruct`s, nothing
allocated), reported as XLA's `memory_analysis()` plus each device's bytes by category:

- `train_step` (`step_memory`): the draft's micro-batch gradient step and the optimizer update; with
  `data.features=online` the step also holds the whole frozen target and runs its forward
  (`run.online`), and its batch is token rows only.
- `target_forward` (`target_forward_memory`): the cache builder's target forward
  (`dspark_jax.cache.features`: aux layer outputs and the post-norm last hidden state, bf16) over the
  whole target of shape `target.arch`, no weights read.

Without `devices` a program is compiled on one local device, everything resident there (pure data
parallelism, as in the seed's 4-GPU setup: an upper bound for FSDP). With the compile-only `devices` of a
named topology (`dspark_jax.training.topology`) it is compiled by that platform's compiler over the run's
mesh (`config.mesh` over those devices) with the run's shardings (`config.sharding.rules`): parameters,
optimizer state and gradients as the rules lay them out (the target's routed experts, like its other
weights, sliced along 'embed' over 'fsdp' by default), the frozen target matrices on ('vocab', 'embed'),
`micro_batch` (train step) or `rows` (target forward) rows per batch shard.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import groups, sharding
from dspark_jax.cache import features
from dspark_jax.data import batch as batch_lib
from dspark_jax.draft.model import DraftVocab, FrozenTarget
from dspark_jax.run import config_lib, draft_state, online
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.target import TargetConfig
from dspark_jax.target.generate import prompt_bucket
from dspark_jax.target.load import abstract_model
from dspark_jax.training import step as step_lib

GB = 1e9
PROGRAMS = ("train_step", "target_forward")


def _analysis(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {name: int(getattr(m, name)) for name in fields}


def kernels(compiled) -> list[str]:
    """The Pallas kernels in a compiled program (Mosaic custom calls: 'tpu_custom_call' for TPU,
    'mosaic_gpu...' for GPU), by custom-call target; [] when it has none."""
    targets = set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text() or ""))
    return sorted(t for t in targets if t == "tpu_custom_call" or t.startswith("mosaic"))


def _placed(tree, shardings):
    """`ShapeDtypeStruct`s of `tree`'s leaves carrying `shardings` (one sharding, or a matching tree)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


def _mesh(config, devices: Sequence[jax.Device] | None):
    """One local device, or `config.mesh` over the compile-only `devices` of a topology."""
    if devices is None:
        return sharding.make_mesh(None, jax.devices()[:1])
    return sharding.make_mesh(config.mesh.to_dict(), devices)


def _global_rows(per_shard: int, mesh, rules) -> int:
    """Rows of a batch with `per_shard` rows on each shard of the 'batch' mesh axes."""
    batch_axes = dict(rules).get("batch") or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    return per_shard * math.prod(mesh.shape[a] for a in batch_axes)


def _peak(resident: int, batch: int, memory: dict[str, int]) -> int:
    """One program's peak: the state it runs on, its batch, its temporaries and its outputs, less the
    outputs that reuse donated inputs."""
    return (
        resident
        + batch
        + memory["temp_size_in_bytes"]
        + memory["output_size_in_bytes"]
        - memory["alias_size_in_bytes"]
    )


def _frozen(config, target: TargetConfig, mesh, rules) -> FrozenTarget:
    """The frozen target matrices as the trainer places them (with its draft vocabulary); the group's side
    inputs replicated."""
    dtype = jnp.dtype(config.target.param_dtype)
    v, h = target.vocab_size, target.hidden_size
    place = lambda shape, axes: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, sharding.logical_to_spec(axes, shape, mesh, rules))
    )
    synthetic = groups.get(config.experiment).run.synthetic_side_inputs
    inputs = (
        None
        if synthetic is None
        else _placed(dict(jax.eval_shape(lambda: synthetic(config, v))), NamedSharding(mesh, PartitionSpec()))
    )
    frozen = FrozenTarget(place((v, h), ("vocab", "embed")), place((h, v), ("embed", "vocab")), inputs)
    if n := config.train.get("draft_vocab", 0):  # its size before the EOS ids the cache's ranking adds
        ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
        frozen = frozen._replace(draft_vocab=DraftVocab(ids, place((h, n), ("embed", "vocab"))))
    return frozen


def _batch(fields, mesh, rules):
    """The batch's fields as the trainer places them (`pipeline.to_global`): rows on the 'batch' axes."""
    spec = lambda x: sharding.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh, rules)
    return {
        name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x)))
        for name, x in fields.items()
    }


def step_memory(
    config, micro_batch: int, devices: Sequence[jax.Device] | None = None
) -> dict[str, int | float | dict]:
    """XLA memory analysis of the micro-batch gradient step and of the optimizer update, and each
    device's bytes by category (`per_device_bytes`), for `micro_batch` rows per batch shard.

    `devices`: compile-only devices of a topology (`topology.compile_devices`); None = one local device.
    """
    config_lib.validate(config)
    experiment = groups.get(config.experiment)
    target = TargetConfig.from_json(config.target.arch.to_dict())
    rules = config_lib.sharding_rules(config)
    mesh = _mesh(config, devices)
    replicated = NamedSharding(mesh, PartitionSpec())

    graphdef, params, rest = draft_state.abstract_draft(config, target)
    params = sharding.with_shardings(params, mesh, rules)
    rest = _placed(rest, replicated)
    frozen = _frozen(config, target, mesh, rules)
    step_features = None
    if not config_lib.reads_states(config):  # online: the whole target rides along, its forward in the step
        model = abstract_model(target, jnp.dtype(config.target.param_dtype), jnp.dtype(config.target.dtype))
        frozen = frozen._replace(target_state=sharding.with_shardings(nnx.state(model), mesh, rules))
        step_features = online.online_features(config, model)
    rows = _global_rows(micro_batch, mesh, rules)
    batch = _batch(
        batch_lib.abstract_device_batch(rows, config_lib.batch_dims(config, target.hidden_size)), mesh, rules
    )

    micro_fn = functools.partial(
        step_lib.micro_step, graphdef=graphdef, experiment=experiment, features=step_features
    )
    # Traced under the mesh: the block attention dispatcher and Pallas lower for the mesh's platform.
    with jax.set_mesh(mesh), sharding.activation_sharding(mesh, rules):
        micro = jax.jit(micro_fn).lower(params, rest, frozen, batch).compile()
        accumulators = _placed(jax.eval_shape(micro_fn, params, rest, frozen, batch), micro.output_shardings)
    grads, sums = accumulators
    _, optimizer = optimizer_lib.make_training_optimizer(
        config, params, draft_state.copied_mask(config, target)
    )
    opt_state = _placed(
        jax.eval_shape(optimizer.init, params),
        optimizer_lib.optimizer_state_shardings(optimizer, params, mesh),
    )
    update_fn = functools.partial(step_lib.apply_step, optimizer=optimizer, experiment=experiment)
    update = jax.jit(update_fn, donate_argnums=(0, 1)).lower(params, opt_state, grads, sums).compile()

    micro_mem, update_mem = _analysis(micro), _analysis(update)
    per_device = {
        "parameters": sharding.device_bytes(params),
        "other_draft_state": sharding.device_bytes(rest),
        "optimizer_state": sharding.device_bytes(opt_state),
        "gradient_accumulators": sharding.device_bytes(accumulators),
        "frozen_target": sharding.device_bytes(frozen._replace(target_state=None)),
        "online_target_state": sharding.device_bytes(frozen.target_state),
        "batch": sharding.device_bytes(batch),
        "micro_step_temporaries": micro_mem["temp_size_in_bytes"],
        "update_temporaries": update_mem["temp_size_in_bytes"],
    }
    resident = sum(
        per_device[k]
        for k in (
            "parameters",
            "other_draft_state",
            "optimizer_state",
            "gradient_accumulators",
            "frozen_target",
            "online_target_state",
        )
    )
    # Peak: a micro-step runs on top of the resident state and accumulators with its batch, temporaries
    # and new gradients; the update replaces the accumulators' sum by its temporaries and fresh outputs.
    peak = max(_peak(resident, per_device["batch"], micro_mem), _peak(resident, 0, update_mem))
    return {
        "program": "train_step",
        "features": config.data.get("features", "offline"),
        "draft_parameters": sum(x.size for x in jax.tree.leaves(params)),
        "devices": len(mesh.devices.flat),
        "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": dict(mesh.shape),
        "micro_batch_per_shard": micro_batch,
        "global_micro_batch": rows,
        "micro_step": micro_mem,
        "kernels": kernels(micro),
        "update": update_mem,
        "per_device_bytes": per_device,
        "estimated_peak_bytes": peak,
        "estimated_peak_gb": round(peak / GB, 2),
    }


def _is_expert(variable: nnx.Variable) -> bool:
    """A routed expert's weights: a variable with the 'expert' logical axis."""
    return "expert" in (variable.get_metadata().get("axes") or ())


def target_forward_memory(
    config, rows: int, devices: Sequence[jax.Device] | None = None
) -> dict[str, int | float | str | dict]:
    """XLA memory analysis of the cache builder's target forward and each device's bytes by category
    (`per_device_bytes`), for `rows` rows per batch shard of the longest bucket the builder runs
    (`data.max_length` rounded up to a power of two).

    The forward is `cache.features`' own function over the whole target of shape `target.arch` in
    `target.param_dtype` / `target.dtype`: its state laid out by the sharding rules (the routed experts'
    weights on their own line, the rest, RoPE frequencies included, as other target state), the packed
    `tokens` / `positions` rows on the 'batch' axes, the outputs where XLA puts them. `devices` as in
    `step_memory`.
    """
    config_lib.validate(config)
    target = TargetConfig.from_json(config.target.arch.to_dict())
    rules = config_lib.sharding_rules(config)
    mesh = _mesh(config, devices)
    model = abstract_model(target, jnp.dtype(config.target.param_dtype), jnp.dtype(config.target.dtype))
    graphdef, state = nnx.split(model)
    state = sharding.with_shardings(state, mesh, rules)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    experts = [v.get_value() for v in variables if _is_expert(v)]
    others = [v.get_value() for v in variables if not _is_expert(v)]
    global_rows, length = _global_rows(rows, mesh, rules), prompt_bucket(config.data.max_length)
    batch = _batch(
        {
            "tokens": jax.ShapeDtypeStruct((global_rows, length), jnp.int32),
            "positions": jax.ShapeDtypeStruct((global_rows, length), jnp.int32),
        },
        mesh,
        rules,
    )
    forward = jax.jit(
        functools.partial(
            features.state_features, graphdef=graphdef, aux_layer_ids=tuple(config.data.aux_layer_ids)
        )
    )
    with jax.set_mesh(mesh), sharding.activation_sharding(mesh, rules):
        compiled = forward.lower(state, batch["tokens"], batch["positions"]).compile()
    outputs = _placed(
        jax.eval_shape(forward, state, batch["tokens"], batch["positions"]), compiled.output_shardings
    )
    memory = _analysis(compiled)
    per_device = {
        "expert_parameters": sharding.device_bytes(experts),
        "other_target_state": sharding.device_bytes(others),
        "batch": sharding.device_bytes(batch),
        "outputs": sharding.device_bytes(outputs),
        "temporaries": memory["temp_size_in_bytes"],
    }
    resident = per_device["expert_parameters"] + per_device["other_target_state"]
    peak = _peak(resident, per_device["batch"], memory)
    return {
        "program": "target_forward",
        "target_parameters": sum(v.get_value().size for v in variables if isinstance(v, nnx.Param)),
        "expert_sharding": {
            ",".join(v.get_metadata()["axes"]): str(v.get_value().sharding.spec)
            for v in variables
            if _is_expert(v)
        },
        "devices": len(mesh.devices.flat),
        "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": dict(mesh.shape),
        "rows_per_shard": rows,
        "global_rows": global_rows,
        "tokens_per_row": length,
        "forward": memory,
        "per_device_bytes": per_device,
        "estimated_peak_bytes": peak,
        "estimated_peak_gb": round(peak / GB, 2),
    }
