"""The training loop: `train(config, workdir)`.

Reads like the run it performs: mesh, target side and caches, draft and optimizer, input
pipelines, checkpoint restore, then the loop (one optimizer step over `grad_accum`
micro-batches, metrics of step N-1 fetched after step N is dispatched, evaluation,
checkpoints, preemption). Rerunning with the same work directory resumes from the latest
checkpoint, with the data iterator exactly where it was.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from dspark_jax import groups, sharding
from dspark_jax.data.batch import COUNTED_FIELDS, batch_counts, device_fields
from dspark_jax.data.pipeline import make_iterator, to_global
from dspark_jax.run import config_lib, draft_state, sources, target_side
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.run.checkpoints import Checkpointer
from dspark_jax.training import evaluation
from dspark_jax.training import step as step_lib
from dspark_jax.training.metrics_writer import MetricWriter
from dspark_jax.training.preemption import PreemptionGuard
from dspark_jax.training.progress import ProgressLogger
from dspark_jax.training.summary import write_summary

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; the message names the step."""


class Preempted(Exception):
    """The run stopped on a preemption request after saving `step`; rerunning the command resumes it."""

    def __init__(self, step: int):
        super().__init__(f"preempted at step {step}: checkpoint saved; rerun the same command to resume")
        self.step = step


def check_workdir(workdir: epath.Path, config, allow_changed: Sequence[str] = ()) -> None:
    """Before any work: the work directory is usable, and a run already in it has the same settings."""
    if workdir.exists() and not workdir.is_dir():
        raise config_lib.UsageError(
            f"--workdir {workdir} is a file; give a directory (new or a run to resume)"
        )
    if not (workdir / "checkpoints").is_dir():
        return
    with Checkpointer(workdir / "checkpoints") as checkpointer:
        step = checkpointer.latest_step()
        stored = checkpointer.meta(step).get("config") if step is not None else None
    if stored is None:
        return
    conflicts = config_lib.resume_conflicts(config, stored, allow_changed)
    if conflicts:
        given, saved = config_lib.flatten(config.to_dict()), config_lib.flatten(stored)
        shown = ", ".join(f"{k} (run {saved.get(k)!r}, now {given.get(k)!r})" for k in conflicts[:4])
        raise config_lib.UsageError(
            f"{workdir} holds a run (step {step}) with other settings: {shown}; resume it with its own "
            f"settings, use a new --workdir, or pass --allow_changed={','.join(conflicts)} to resume anyway"
        )


def split_micro_batches(batch: Mapping[str, np.ndarray], num: int) -> list[dict[str, np.ndarray]]:
    """The device fields of a per-process batch cut into `num` equal micro-batches."""
    rows = batch["input_ids"].shape[0]
    if rows % num:
        raise ValueError(
            f"per-process batch of {rows} rows does not split into train.grad_accum={num} micro-batches"
        )
    size = rows // num
    fields = device_fields(batch)
    return [{k: v[i * size : (i + 1) * size] for k, v in fields.items()} for i in range(num)]


def forward_seconds(features: step_lib.Features, frozen, micro_batch, repeats: int = 5) -> float:
    """Seconds of the online feature pass alone (the target's forward) on one micro-batch, compiled: the
    median of `repeats` runs, so one slow run (a busy host) does not set the figure."""
    forward = jax.jit(features)
    jax.block_until_ready(forward(frozen, micro_batch))
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(forward(frozen, micro_batch))
        seconds.append(time.perf_counter() - began)
    return float(np.median(seconds))


def _scalars(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in jax.device_get(dict(metrics)).items()}


def train(config, workdir: str | os.PathLike, allow_changed: Sequence[str] = ()) -> dict[str, float]:
    """Trains the draft described by `config` in `workdir` (a local path or gs://...); returns the last
    logged metrics. Resuming a run whose stored config differs on a training key (not in
    `config_lib.RESUMABLE_KEYS`) is refused unless the key is in `allow_changed`. Raises `Preempted`
    after saving when a stop was requested."""
    called = time.perf_counter()  # `wall_minutes` counts from here: caches and compiles included
    config_lib.validate(config)
    workdir = epath.Path(workdir)
    check_workdir(workdir, config, allow_changed)
    spec = config_lib.loop_spec(config)
    mesh, rules = spec.mesh, spec.rules
    experiment = groups.get(config.experiment)
    # A run that starts from another one's checkpoint logs on the cumulative axis: its steps + `offset`.
    pretrained = draft_state.init_source(config)
    offset = pretrained[1] if pretrained else 0

    # ---- Mesh, target side, caches -------------------------------------------------------
    stages = {"caches": -time.perf_counter()}
    side, cache_paths = target_side.prepare_target_side(config, mesh)
    train_source = sources.open_source(cache_paths["train"], config, side)
    val_source = sources.open_source(cache_paths["val"], config, side)
    log.info("caches: train %d samples, val %d samples", len(train_source), len(val_source))
    stages["caches"] += time.perf_counter()
    stages["setup"] = -time.perf_counter()

    # ---- Draft, optimizer -------------------------------------------------------------------
    checkpointer = Checkpointer(
        workdir / "checkpoints", max_to_keep=spec.max_to_keep, save_interval_steps=spec.checkpoint_every
    )
    latest = checkpointer.latest_step()  # 0: a checkpoint written by `import_draft`
    start = latest or 0
    read_target = target_side.target_reader(config, lambda: target_side.load_run_target(config, mesh))
    graphdef, params, rest = draft_state.init_draft(config, side.config, mesh, read_target)
    if pretrained and not start:
        params = draft_state.warm_start(config, side.config, mesh, params, pretrained)
    copied = draft_state.copied_mask(config, side.config)
    schedule, optimizer = optimizer_lib.make_training_optimizer(config, params, copied)
    opt_state = optimizer_lib.init_optimizer_state(optimizer, params, mesh)

    # ---- Input pipelines ----------------------------------------------------------------------
    train_iter = make_iterator(
        train_source,
        sources.pipeline_config(
            config, side, batch_size=spec.global_batch, seed=spec.train_seed, num_epochs=None
        ),
    )

    def val_batches():
        return make_iterator(
            val_source,
            sources.pipeline_config(config, side, batch_size=spec.micro_rows, seed=spec.seed, num_epochs=1),
        )

    # ---- Checkpoint restore -------------------------------------------------------------------
    state = {"params": params, "opt_state": opt_state}
    if latest is not None:
        # An imported checkpoint holds no iterator position: its data starts from the beginning.
        resumed_iter = train_iter if checkpointer.has_data_iter(latest) else None
        state, _ = checkpointer.restore(
            latest, draft_state.abstract_state(state, mesh), data_iter=resumed_iter
        )
        log.info("resumed from step %d", start)
    writer = MetricWriter(workdir, resume_step=offset + start)
    progress = ProgressLogger(spec.stop_step, start)
    meta = {"config": config_lib.to_stored(config), "pretrained_steps": offset}

    # ---- Compiled steps -----------------------------------------------------------------------
    micro_step = jax.jit(
        functools.partial(
            step_lib.micro_step, graphdef=graphdef, experiment=experiment, features=side.features
        )
    )
    accumulate = jax.jit(step_lib.accumulate, donate_argnums=0)
    apply_step = jax.jit(
        functools.partial(step_lib.apply_step, optimizer=optimizer, experiment=experiment),
        donate_argnums=(0, 1),
    )
    train_metrics = jax.jit(experiment.model.metrics)
    count = jax.jit(batch_counts)
    # The ablations (tau_prob without the context, ...) cost a forward each: measured at the run's last
    # evaluation, or at every one with `train.ablate_every_eval`.
    eval_sums = evaluation.make_eval_sums(graphdef, experiment, side.features, ablate=False)
    ablated_eval_sums = evaluation.make_eval_sums(graphdef, experiment, side.features)

    # ---- Loop ---------------------------------------------------------------------------------
    last: dict[str, float] = {}
    pending = None  # (step, device metrics, batch counts, host stats) of the step before the current one

    def finish(record):
        """Fetches a dispatched step's metrics, checks them and logs them."""
        nonlocal last
        step, device_metrics, counts, host = record
        counts = {k: int(v) for k, v in jax.device_get(counts).items()}
        host = host | {
            "train/tokens_per_second": counts["tokens"] / host["train/step_seconds"],
            "train/anchors_per_row": counts["anchors"] / counts["rows"],
            "train/samples_per_step": float(counts["samples"]),
        }
        metrics = _scalars(device_metrics, "train") | host
        if not math.isfinite(metrics["train/loss"]) or not math.isfinite(metrics["train/grad_norm"]):
            raise NonFiniteLossError(
                f"non-finite loss or gradient at step {step}: loss={metrics['train/loss']}, "
                f"grad_norm={metrics['train/grad_norm']}; the last checkpoint is intact"
            )
        if step % spec.log_every == 0 or step == spec.stop_step:
            writer.write(offset + step, metrics | ({"train/new_steps": step} if pretrained else {}))
            last = metrics
        progress.update(step, {"loss": metrics["train/loss"], "tau": metrics["train/tau_prob"]})

    stop, computed = False, 0
    periods: list[float] = []  # wall seconds of each step after the first (compiled)
    features = {"mode": "online" if side.features else "offline"}
    log.info(
        "features: %s",
        "online (the frozen target runs in every micro-step)"
        if side.features
        else "offline (from the cache)",
    )
    stages["setup"] += time.perf_counter()
    stages |= {"first_step": 0.0, "train": -time.perf_counter(), "eval": 0.0}
    log.info("step %d: compiling the train step (the first step takes longer)", start + 1)
    with PreemptionGuard() as guard, sharding.activation_sharding(mesh, rules):
        for step in range(start + 1, spec.stop_step + 1):
            began = time.perf_counter()
            batch = next(train_iter)
            grads = sums = None
            for micro_batch in split_micro_batches(batch, spec.grad_accum):
                g, s = micro_step(state["params"], rest, side.frozen, to_global(micro_batch, mesh, rules))
                grads, sums = (g, s) if grads is None else (accumulate(grads, g), accumulate(sums, s))
            counts = count(to_global({k: batch[k] for k in COUNTED_FIELDS}, mesh, rules))
            params, opt_state, grad_norm = apply_step(state["params"], state["opt_state"], grads, sums)
            state = {"params": params, "opt_state": opt_state}
            computed += 1
            device_metrics = train_metrics(sums) | {
                "grad_norm": grad_norm,
                "learning_rate": schedule(step - 1),
            }
            if pending is not None:
                finish(pending)
            host = {
                "train/step_seconds": time.perf_counter() - began,
                "train/wall_minutes": (time.perf_counter() - called) / 60,
            }
            pending = (step, device_metrics, counts, host)
            if step > start + 1:
                periods.append(host["train/step_seconds"])
            if step == start + 1:
                jax.block_until_ready(grad_norm)
                stages["first_step"] = time.perf_counter() - began
                log.info("step %d: compiled and ran in %.1f s", step, stages["first_step"])
                if side.features is not None:  # timed apart, its compile counted in the first step
                    timing = time.perf_counter()
                    one = to_global(micro_batch, mesh, rules)
                    features["target_seconds_per_step"] = spec.grad_accum * forward_seconds(
                        side.features, side.frozen, one
                    )
                    stages["first_step"] += time.perf_counter() - timing
                    log.info(
                        "online: the target's forward takes %.3f s of each step",
                        features["target_seconds_per_step"],
                    )

            # Evaluate before saving: a kill after the save never loses this step's eval line.
            if (spec.eval_every and step % spec.eval_every == 0) or step == spec.stop_step:
                if pending is not None:
                    finish(pending)
                    pending = None
                eval_began = time.perf_counter()
                metrics = evaluation.evaluate(
                    ablated_eval_sums if spec.ablate_every_eval or step == spec.stop_step else eval_sums,
                    experiment,
                    state["params"],
                    rest,
                    side.frozen,
                    val_batches(),
                    mesh,
                    spec.eval_batches,
                    rules,
                )
                stages["eval"] += time.perf_counter() - eval_began
                metrics = dict(metrics) | {"wall_minutes": (time.perf_counter() - called) / 60}
                writer.write(offset + step, {f"eval/{k}": v for k, v in metrics.items()})
                last = last | {f"eval/{k}": v for k, v in metrics.items()}
                log.info(
                    "step %d eval: tau_prob %.4f, accept_rate_0 %.4f%s",
                    step,
                    metrics["tau_prob"],
                    metrics["accept_rate_0"],
                    "".join(
                        f", without {a.name} {metrics[f'tau_prob_without_{a.name}']:.4f}"
                        for a in experiment.report.evaluation_ablations
                        if f"tau_prob_without_{a.name}" in metrics
                    ),
                )
            # Every process reaches the preemption sync point on every step.
            stop = guard.should_stop(step)
            if step % spec.checkpoint_every == 0 or step == spec.stop_step or stop:
                if pending is not None:
                    finish(pending)  # never checkpoint a non-finite state
                    pending = None
                writer.flush()  # a URL work directory's metrics.jsonl holds every line up to the checkpoint
                checkpointer.save(step, state, data_iter=train_iter, meta={"step": step, **meta}, force=True)
            if stop:
                break
    checkpointer.wait()
    stages["train"] += time.perf_counter() - stages["eval"] - stages["first_step"]
    writer.close()
    if "target_seconds_per_step" in features and periods:
        draft = float(np.median(periods)) - features["target_seconds_per_step"]
        features["draft_seconds_per_step"] = round(draft, 4)  # the median step after the first: compiled
        features["target_seconds_per_step"] = round(features["target_seconds_per_step"], 4)
    write_summary(workdir, checkpointer, stages, offset, (start, computed), features)
    checkpointer.close()
    if stop and step < spec.stop_step:
        raise Preempted(step)
    return last
