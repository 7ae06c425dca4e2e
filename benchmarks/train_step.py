"""Training step time and tokens/s of the demo and smoke presets (block attention alone: block_attention.py).

  python benchmarks/train_step.py [--steps=5] [--presets=smoke,demo] \
      [--config=configs/baseline.py,configs/memory.py] \
      [--overrides=train.global_batch=4,train.grad_accum=1] [--shape_only] [--peak_tflops=989]

With several configs (comma-separated) each row also shows its step time relative to the first
config's at the same preset (e.g. Draft Memory's two-stage step next to the baseline's).
`time_step(..., features="online")` runs a random target of the preset's shape inside the step
(`data.features=online`; `benchmarks/online_training.py` prints both).

Step timing uses synthetic batches with each preset's exact shapes (values do not change
the work), so no cache is needed; `paper` uses the seed's target shape without its weights.
`--overrides` sets config keys (`section.key=value`, comma-separated) for every preset, e.g. one
micro-batch per step to time the paper micro-step on one accelerator, or `train.draft_vocab=8192` (the
draft's logits over 8,192 of the vocabulary's columns).

`--peak_tflops` (one device's dense bf16 peak, e.g. 989 for an H100/H200 SXM) adds the baseline draft's
model FLOPs per step (`model_flops`: 6 x trainable weights x tokens, 4 x the frozen LM head per slot
and 2 x the teacher head, attention over each block's visible keys; no remat recompute) and MFU =
model FLOPs / (step seconds x devices x peak). Other experiment groups add work this count omits: '-'.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_config_module
from dspark_jax import groups, sharding
from dspark_jax.data import batch as batch_lib
from dspark_jax.data.pipeline import to_global
from dspark_jax.draft.model import DraftConfig, FrozenTarget, make_draft_vocab
from dspark_jax.run import config_lib, draft_state, online
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.target import TargetConfig
from dspark_jax.target.checkpoint import default_target_path, load_checkpoint
from dspark_jax.target.model import Transformer
from dspark_jax.training import step as step_lib


def preset_target(config, shape_only: bool = False) -> TargetConfig:
    """The target shape of a preset: its `arch` for random and paper targets (or with `shape_only`), else
    the checkpoint's."""
    if shape_only or config.target.random_init or (config.preset == "paper" and not config.target.path):
        return TargetConfig.from_json(config.target.arch.to_dict())
    return load_checkpoint(config.target.path or default_target_path()).config


def apply_overrides(config, overrides: str):
    """`section.key=value,...` set on a config (values parsed as Python literals when they are)."""
    for item in filter(None, overrides.split(",")):
        name, _, text = item.partition("=")
        section, key = name.split(".")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        config[section][key] = value
    return config


def model_flops(cfg: DraftConfig, positions_BxT: np.ndarray, anchors_BxN: np.ndarray) -> float:
    """Model FLOPs of the baseline draft's forward and backward on one micro-batch (no remat recompute).

    Per slot (`N * S` a row): the layers' projections and MLP (`6 x` weights: forward, input and weight
    gradients), the frozen LM head (`4 x`: forward and input gradient), the teacher's head (`2 x`,
    forward only), the Markov `W2` and the confidence head (`6 x`). Per context position (`T` a row): the
    aux projection and every layer's context keys/values (`6 x`). Attention: `12 x D` per query head and
    visible key (QK and PV forward, four matmuls backward); block `n` sees its sample's context before its
    anchor (`positions[a_n]` keys) and its own `S` slots.
    """
    h, q, g, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    v, r, s, layers = cfg.vocab_size, cfg.markov_rank, cfg.block_size, cfg.num_layers
    b, t = positions_BxT.shape
    slots = b * anchors_BxN.shape[1] * s
    per_slot_weights = layers * (2 * h * q * d + 2 * h * g * d + 3 * h * f) + r * v + h + r
    per_context_weights = cfg.num_aux * h * h + layers * 2 * h * g * d
    visible = np.take_along_axis(positions_BxT, anchors_BxN, axis=1).astype(np.int64) + s  # keys per block
    attention = 12 * d * q * s * float(visible.sum()) * layers
    return 6.0 * (slots * per_slot_weights + b * t * per_context_weights) + 6.0 * slots * h * v + attention


def online_frozen(config, target: TargetConfig, frozen: FrozenTarget, mesh) -> tuple[FrozenTarget, object]:
    """`frozen` with a random target of shape `target` (placed by the run's rules) and the online step's
    feature pass (`run.online`): the step's work does not depend on the weights' values."""
    model = Transformer(
        target,
        rngs=nnx.Rngs(0),
        param_dtype=jnp.dtype(config.target.param_dtype),
        dtype=jnp.dtype(config.target.dtype),
    )
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, sharding.state_shardings(state, mesh, config_lib.sharding_rules(config)))
    return frozen._replace(target_state=state), online.online_features(config, nnx.merge(graphdef, state))


def time_step(
    config_module, preset: str, steps: int, overrides: str = "", shape_only: bool = False, features="offline"
) -> dict[str, float]:
    config = apply_overrides(config_module.get_config(preset), overrides)
    config.data.features = features
    experiment = groups.get(config.experiment)
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = preset_target(config, shape_only)
    graphdef, params, rest = draft_state.init_draft(draft_state.random_init(config), target, mesh)  # timing
    _, optimizer = optimizer_lib.make_training_optimizer(config, params)
    opt_state = optimizer_lib.init_optimizer_state(optimizer, params, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.random.split(jax.random.key(0))
    frozen = jax.device_put(
        FrozenTarget(
            0.02
            * jax.random.normal(key[0], (target.vocab_size, target.hidden_size), config.target.param_dtype),
            0.02
            * jax.random.normal(key[1], (target.hidden_size, target.vocab_size), config.target.param_dtype),
            None
            if experiment.run.synthetic_side_inputs is None
            else dict(experiment.run.synthetic_side_inputs(config, target.vocab_size)),
        ),
        replicated,
    )
    if (
        size := config.train.draft_vocab
    ):  # `train.draft_vocab=N`: N columns (which ones does not change the work)
        ids_K = np.arange(size, dtype=np.int32)
        frozen = frozen._replace(
            draft_vocab=make_draft_vocab(frozen.lm_head_HxV, ids_K, replicated, replicated)
        )
    micro_rows = config.train.global_batch // config.train.grad_accum
    host_batch = batch_lib.synthetic(
        micro_rows, config_lib.batch_dims(config, target.hidden_size), target.vocab_size
    )
    batch = to_global(batch_lib.device_fields(host_batch), mesh)
    online_features = None
    if features == "online":
        frozen, online_features = online_frozen(config, target, frozen, mesh)
    micro = jax.jit(
        functools.partial(
            step_lib.micro_step, graphdef=graphdef, experiment=experiment, features=online_features
        )
    )
    update = jax.jit(
        functools.partial(step_lib.apply_step, optimizer=optimizer, experiment=experiment),
        donate_argnums=(0, 1),
    )

    def one_step(params, opt_state):
        grads, sums = micro(params, rest, frozen, batch)
        for _ in range(config.train.grad_accum - 1):
            grads, sums = step_lib.accumulate((grads, sums), micro(params, rest, frozen, batch))
        params, opt_state, norm = update(params, opt_state, grads, sums)
        jax.block_until_ready(norm)
        return params, opt_state

    params, opt_state = one_step(params, opt_state)  # compile
    begin = time.perf_counter()
    for _ in range(steps):
        params, opt_state = one_step(params, opt_state)
    seconds = (time.perf_counter() - begin) / steps
    tokens = config.train.global_batch * config.data.max_length
    flops = (
        config.train.grad_accum
        * model_flops(
            draft_state.draft_config(config, target), host_batch["positions"], host_batch["anchors"]
        )
        if config.experiment == "baseline"
        else float("nan")
    )
    return {
        "step_seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "samples_per_second": config.train.global_batch / seconds,
        "model_flops": flops,
        "devices": mesh.devices.size,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--presets", default="smoke,demo")
    parser.add_argument("--config", default="configs/baseline.py", help="config files, comma-separated")
    parser.add_argument("--overrides", default="", help="section.key=value,... for every preset")
    parser.add_argument("--shape_only", action="store_true", help="target shape from target.arch (no GGUF)")
    parser.add_argument(
        "--peak_tflops", type=float, default=0.0, help="one device's dense bf16 TFLOP/s: adds MFU (0 = off)"
    )
    args = parser.parse_args()
    config_paths = args.config.split(",")
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    header = ("step s", "tokens/s", "samples/s", "vs first")
    if args.peak_tflops:
        header += ("TFLOP/step", "TFLOP/s", "MFU")
    print(f"{'preset':8s} {'experiment':20s} " + " ".join(f"{h:>10s}" for h in header))
    for preset in args.presets.split(","):
        first = None
        for path in config_paths:
            config_module = load_config_module(path)
            r = time_step(config_module, preset, args.steps, args.overrides, args.shape_only)
            step_s, tok_s, smp_s = r["step_seconds"], r["tokens_per_second"], r["samples_per_second"]
            first = first or step_s
            name = config_module.get_config(preset).experiment
            line = f"{preset:8s} {name:20s} {step_s:10.3f} {tok_s:10.0f} {smp_s:10.2f} {step_s / first:9.2f}x"
            if args.peak_tflops:
                achieved = r["model_flops"] / step_s / 1e12
                mfu = achieved / (args.peak_tflops * r["devices"])
                line += (
                    f" {r['model_flops'] / 1e12:10.1f} {achieved:10.1f} {mfu:10.1%}"
                    if np.isfinite(achieved)
                    else f" {'-':>10s} {'-':>10s} {'-':>10s}"
                )
            print(line)


if __name__ == "__main__":
    main()
