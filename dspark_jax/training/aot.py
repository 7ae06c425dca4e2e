"""Ahead-of-time memory check: does one device's share of a training step fit, before renting a pod?

  python -m dspark_jax.check_memory --config=configs/baseline.py:paper [--micro_batch=4]
  python -m dspark_jax.check_memory --config=configs/baseline.py:paper --topology=tpu-v5p-8

Compiles the micro-batch gradient step and the optimizer update for abstract inputs
(`jax.ShapeDtypeStruct`s, nothing allocated) and reports XLA's `memory_analysis()` plus each
device's bytes by category. Without `devices` the step is compiled on one local device, everything
resident there (pure data parallelism, as in the seed's 4-GPU setup: an upper bound for FSDP). With
the compile-only `devices` of a named topology (`dspark_jax.training.topology`) it is compiled by that
platform's compiler over the trainer's mesh (`config.mesh` over those devices) with the trainer's
shardings (`config.sharding.rules`): parameters, optimizer state and gradients as the rules lay them
out, the frozen target matrices on ('vocab', 'embed'), `micro_batch` rows per batch shard.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import groups, sharding
from dspark_jax.data import batch as batch_lib
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.run import config_lib, draft_state
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.target import TargetConfig
from dspark_jax.training import step as step_lib

GB = 1e9


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


def _device_bytes(tree) -> int:
    """Bytes of one device's shards of the placed leaves of `tree`."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


def _frozen(config, target: TargetConfig, mesh, rules) -> FrozenTarget:
    """The frozen target matrices as the trainer places them; the group's side inputs replicated."""
    dtype = jnp.dtype(config.target.param_dtype)
    v, h = target.vocab_size, target.hidden_size
    place = lambda shape, axes: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, sharding.logical_to_spec(axes, shape, mesh, rules))
    )
    abstract_inputs = groups.get(config.experiment).abstract_side_inputs
    inputs = (
        None
        if abstract_inputs is None
        else _placed(dict(abstract_inputs(config, v)), NamedSharding(mesh, PartitionSpec()))
    )
    return FrozenTarget(place((v, h), ("vocab", "embed")), place((h, v), ("embed", "vocab")), inputs)


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
    mesh = (
        sharding.make_mesh(None, jax.devices()[:1])
        if devices is None
        else sharding.make_mesh(config.mesh.to_dict(), devices)
    )
    replicated = NamedSharding(mesh, PartitionSpec())

    graphdef, params, rest = draft_state.abstract_draft(config, target)
    params = sharding.with_shardings(params, mesh, rules)
    rest = _placed(rest, replicated)
    frozen = _frozen(config, target, mesh, rules)
    batch_axes = dict(rules).get("batch") or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    rows = micro_batch * math.prod(mesh.shape[a] for a in batch_axes)
    batch = _batch(
        batch_lib.abstract_device_batch(rows, batch_lib.Dims.of(config, target.hidden_size)), mesh, rules
    )

    micro_fn = functools.partial(step_lib.micro_step, graphdef=graphdef, experiment=experiment)
    # Traced under the mesh: the block attention dispatcher and Pallas lower for the mesh's platform.
    with jax.set_mesh(mesh), sharding.activation_sharding(mesh, rules):
        micro = jax.jit(micro_fn).lower(params, rest, frozen, batch).compile()
        accumulators = _placed(jax.eval_shape(micro_fn, params, rest, frozen, batch), micro.output_shardings)
    grads, sums = accumulators
    _, optimizer = optimizer_lib.make_training_optimizer(config, params)
    opt_state = _placed(
        jax.eval_shape(optimizer.init, params),
        optimizer_lib.optimizer_state_shardings(optimizer, params, mesh),
    )
    update_fn = functools.partial(step_lib.apply_step, optimizer=optimizer, experiment=experiment)
    update = jax.jit(update_fn, donate_argnums=(0, 1)).lower(params, opt_state, grads, sums).compile()

    micro_mem, update_mem = _analysis(micro), _analysis(update)
    per_device = {
        "parameters": _device_bytes(params),
        "other_draft_state": _device_bytes(rest),
        "optimizer_state": _device_bytes(opt_state),
        "gradient_accumulators": _device_bytes(accumulators),
        "frozen_target": _device_bytes(frozen),
        "batch": _device_bytes(batch),
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
        )
    )
    # Peak: a micro-step runs on top of the resident state and accumulators with its batch, temporaries
    # and new gradients; the update replaces the accumulators' sum by its temporaries and fresh outputs.
    micro_peak = (
        resident + per_device["batch"] + micro_mem["temp_size_in_bytes"] + micro_mem["output_size_in_bytes"]
    )
    update_peak = (
        resident
        + update_mem["temp_size_in_bytes"]
        + update_mem["output_size_in_bytes"]
        - update_mem["alias_size_in_bytes"]
    )
    peak = max(micro_peak, update_peak)
    return {
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
