"""Ahead-of-time memory check: does one device's share of a training step fit, before renting a pod?

  python -m dspark_jax.check_memory --config=configs/baseline.py:paper [--micro_batch=4]

Compiles the micro-batch gradient step and the optimizer update for abstract inputs
(`jax.ShapeDtypeStruct`s, nothing allocated) on the local backend and prints XLA's
`memory_analysis()` in bytes. The draft's parameters, optimizer state, gradient
accumulator and the frozen target matrices are all counted as resident on one device (pure
data parallelism, as in the seed's 4-GPU setup), so the figure is an upper bound for
FSDP-sharded meshes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax import config_lib, experiments
from dspark_jax.data import batch as batch_lib
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.engram import prepare as engram_prepare
from dspark_jax.target import TargetConfig
from dspark_jax.train import components
from dspark_jax.train import step as step_lib

GB = 1e9


def _analysis(compiled) -> dict[str, float]:
    m = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {name: int(getattr(m, name)) for name in fields}


def step_memory(config, micro_batch: int) -> dict[str, dict[str, int] | float]:
    """XLA memory analysis of the micro-batch gradient step and of the optimizer update (bytes)."""
    config_lib.validate(config)
    experiment = experiments.get(config.experiment)
    target = TargetConfig.from_json(config.target.arch.to_dict())
    graphdef, params, rest = components.abstract_draft(config, target)
    frozen_dtype = jnp.dtype(config.target.param_dtype)
    frozen = FrozenTarget(
        jax.ShapeDtypeStruct((target.vocab_size, target.hidden_size), frozen_dtype),
        jax.ShapeDtypeStruct((target.hidden_size, target.vocab_size), frozen_dtype),
        engram_prepare.synthetic_table(config, target.vocab_size, abstract=True)
        if engram_prepare.uses_engram(config)
        else None,
    )
    batch = batch_lib.abstract_device_batch(micro_batch, batch_lib.Dims.of(config, target.hidden_size))
    micro_fn = functools.partial(step_lib.micro_step, graphdef=graphdef, experiment=experiment)
    micro = jax.jit(micro_fn).lower(params, rest, frozen, batch).compile()
    grads, sums = jax.eval_shape(micro_fn, params, rest, frozen, batch)
    _, optimizer = components.make_training_optimizer(config, params)
    opt_state = jax.eval_shape(optimizer.init, params)
    update_fn = functools.partial(step_lib.apply_step, optimizer=optimizer, experiment=experiment)
    update = jax.jit(update_fn, donate_argnums=(0, 1)).lower(params, opt_state, grads, sums).compile()
    micro_mem, update_mem = _analysis(micro), _analysis(update)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    # Resident: params + optimizer state + gradient accumulators (the update's arguments) + frozen matrices;
    # then one micro-step's batch, temporaries and new gradients on top.
    resident = update_mem["argument_size_in_bytes"] + nbytes(frozen)
    peak = resident + nbytes(batch) + micro_mem["temp_size_in_bytes"] + micro_mem["output_size_in_bytes"]
    params_count = sum(x.size for x in jax.tree.leaves(params))
    return {
        "draft_parameters": params_count,
        "micro_step": micro_mem,
        "update": update_mem,
        "estimated_peak_bytes": peak,
        "estimated_peak_gb": round(peak / GB, 2),
    }
