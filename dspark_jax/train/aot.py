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
from flax import nnx

from dspark_jax.draft.model import DSparkDraft, FrozenTarget
from dspark_jax.target import TargetConfig
from dspark_jax.train import experiment
from dspark_jax.train import step as step_lib

GB = 1e9


def _abstract_batch(config, target: TargetConfig, rows: int) -> dict[str, jax.ShapeDtypeStruct]:
    t, n, k = config.data.max_length, config.train.num_anchors, config.draft.block_size
    a, h = len(config.data.aux_layer_ids), target.hidden_size
    s = jax.ShapeDtypeStruct
    return {
        "input_ids": s((rows, t), jnp.int32),
        "aux_hidden": s((rows, t, a, h), jnp.bfloat16),
        "last_hidden": s((rows, t, h), jnp.bfloat16),
        "anchors": s((rows, n), jnp.int32),
        "labels": s((rows, n, k), jnp.int32),
        "predecessors": s((rows, n, k), jnp.int32),
        "eval_mask": s((rows, n, k), jnp.uint8),
    }


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
    target = TargetConfig.from_json(config.target.arch.to_dict())
    cfg = experiment.draft_config(config, target)
    dtypes = dict(param_dtype=jnp.dtype(config.draft.param_dtype), dtype=jnp.dtype(config.draft.dtype))
    graphdef, params, rest = nnx.split(
        nnx.eval_shape(lambda: DSparkDraft(cfg, rngs=nnx.Rngs(0), **dtypes)), nnx.Param, ...
    )
    frozen_dtype = jnp.dtype(config.target.param_dtype)
    frozen = FrozenTarget(
        jax.ShapeDtypeStruct((target.vocab_size, target.hidden_size), frozen_dtype),
        jax.ShapeDtypeStruct((target.hidden_size, target.vocab_size), frozen_dtype),
    )
    weight = jax.ShapeDtypeStruct((), jnp.float32)
    micro = (
        jax.jit(functools.partial(step_lib.micro_step, graphdef=graphdef))
        .lower(params, rest, frozen, _abstract_batch(config, target, micro_batch), weight)
        .compile()
    )
    _, optimizer = experiment.make_training_optimizer(config)
    opt_state = jax.eval_shape(optimizer.init, params)
    update = (
        jax.jit(functools.partial(step_lib.apply_step, optimizer=optimizer), donate_argnums=(0, 1))
        .lower(params, opt_state, params)
        .compile()
    )
    micro_mem, update_mem = _analysis(micro), _analysis(update)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    # Resident: params + optimizer state + gradient accumulator (the update's arguments) + frozen matrices;
    # then one micro-step's batch, temporaries and new gradients on top.
    resident = update_mem["argument_size_in_bytes"] + nbytes(frozen)
    batch = _abstract_batch(config, target, micro_batch)
    peak = resident + nbytes(batch) + micro_mem["temp_size_in_bytes"] + micro_mem["output_size_in_bytes"]
    params_count = sum(x.size for x in jax.tree.leaves(params))
    return {
        "draft_parameters": params_count,
        "micro_step": micro_mem,
        "update": update_mem,
        "estimated_peak_bytes": peak,
        "estimated_peak_gb": round(peak / GB, 2),
    }
