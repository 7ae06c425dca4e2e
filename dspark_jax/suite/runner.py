"""Runs a suite, resumably: every group trains, is calibrated and decodes speculatively under one protocol.

Layout of the suite's work directory (`root`):

  suite.json                  what ran: suite, preset, protocol, overrides, wall seconds per group and stage
  params.json                 draft parameters per group and how many each adds to the baseline
  <group>/                    the group's training work directory (checkpoints, metrics.jsonl, summary.json,
                              tensorboard/, calibration/step_N/sts.json, inference/ for TensorBoard)
  <group>/evaluation/step_N.json, .npz
                              the final checkpoint's offline metrics on its own blocks and on the prefixes
                              the suite's prefix-picking group picks (`Experiment.model.prefixes`), and per
                              validation sample the sums they are ratios of (the report's intervals)
  <group>/speculate/<s>.json  speculative decoding per temperature x schedule (`t0-fixed`, ...)
  target_only/<s>.json        target-only decoding per setting, shared by every group

A stage whose output exists is skipped; a half-trained group resumes from its last checkpoint (training
resumes bitwise). Stages run in process, so the target is loaded once for every group's decoding and
target-only decoding runs once per setting.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from etils import epath

from dspark_jax import groups as registry
from dspark_jax import sharding
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
from dspark_jax.run import checkpoints, config_lib, draft_state
from dspark_jax.run.config_lib import REPO_ROOT
from dspark_jax.suite import measure, plan
from dspark_jax.target import TargetConfig, target_from_config
from dspark_jax.training.evaluation import measure_checkpoint, open_prefixes, open_validation
from dspark_jax.training.loop import train
from dspark_jax.training.metrics_writer import METRICS_FILE
from dspark_jax.training.summary import SUMMARY_FILE

log = logging.getLogger("dspark_jax.suite")
SUITE_FILE = "suite.json"
PARAMS_FILE = "params.json"
TARGET_ONLY_DIR = "target_only"
SPECULATE_DIR = "speculate"
EVALUATION_DIR = "evaluation"


def setting_name(temperature: float, schedule: str) -> str:
    """`t0-fixed`, `t1-confidence`, ...: a speculative run's file stem."""
    return f"t{temperature:g}-{schedule}"


def _read_json(path: epath.Path):
    return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: epath.Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def _environment() -> dict:
    """Where the suite ran: JAX, backend, devices, host CPUs and the project's commit."""

    def git(*args):
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d.device_kind) for d in jax.devices()],
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
    """Copies the directory `src` to `dst` (local or gs://), file by file."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_dir():
            _copy_tree(path, dst / path.name)
        else:
            path.copy(dst / path.name, overwrite=True)


class SuiteRun:
    """One suite in one work directory; `run()` does whatever is not done yet."""

    def __init__(
        self,
        suite: str,
        preset: str,
        root: str,
        *,
        names: Sequence[str] = (),
        overrides: Sequence[str] = (),
        protocol: plan.Protocol | None = None,
    ):
        self.protocol = protocol or plan.PROTOCOLS[preset]
        if self.protocol.seeds < 1:
            raise config_lib.UsageError(f"--seeds={self.protocol.seeds}: give 1 or more training seeds a row")
        self.groups = plan.with_seeds(plan.groups(suite, names), self.protocol.seeds)
        plan.check_overrides(self.groups, preset, overrides)
        self.root = epath.Path(root)
        self.configs = {}
        budget = [f"train.stop_step={self.protocol.budget}"]
        for group in self.groups:
            config = plan.group_config(group, preset, [*budget, *overrides])
            if group.starts_from:
                source = self.configs[group.starts_from]
                with config.unlocked():
                    config.init.checkpoint = str(self.workdir(group.starts_from))
                    config.init.step = source.train.stop_step
            if group.continues:
                config = self._continued(group, config)
            if group.seed_offset:
                with config.unlocked():
                    config.train.seed = config.seed + group.seed_offset
            self.configs[group.name] = config
        targets = {json.dumps(c.target.to_dict(), sort_keys=True, default=str) for c in self.configs.values()}
        if len(targets) != 1:
            raise config_lib.UsageError(
                "the groups' configs name different targets; a suite compares one target"
            )
        self.record = _read_json(self.root / SUITE_FILE) or {"stages": {}}
        previous = self.record.get("preset")
        if previous not in (None, preset) or self.record.get("suite") not in (None, suite):
            raise config_lib.UsageError(
                f"{self.root} holds suite {self.record.get('suite')}:{previous}; use another --workdir"
            )
        self.record |= {
            "suite": suite,
            "preset": preset,
            "groups": [g.name for g in self.groups],
            "overrides": list(overrides),
            "protocol": {
                "budget": self.protocol.budget,
                "seeds": self.protocol.seeds,
                "input": str(GSM8K_VAL256),
                "limit": self.protocol.limit,
                "max_new_tokens": self.protocol.max_new_tokens,
                "concurrency": self.protocol.concurrency,
                "settings": [list(x) for x in self.protocol.settings],
                "time_phases": self.protocol.time_phases,
            },
        }

    def _continued(self, group: plan.Group, config):
        """The config of a same-budget row: its source's run to the cumulative step of `budget_of`'s."""
        starter = self.configs[group.budget_of]
        stop = starter.init.step + starter.train.stop_step
        if stop > config.train.total_steps:
            raise config_lib.UsageError(
                f"the same-budget row {group.name} continues {group.continues} to step {stop}, past its "
                f"schedule's train.total_steps={config.train.total_steps}; give --budget="
                f"{config.train.total_steps // 2} or less"
            )
        with config.unlocked():
            config.train.stop_step = stop
        return config

    def workdir(self, name: str) -> epath.Path:
        return self.root / name

    def speculate_file(self, name: str, temperature: float, schedule: str) -> epath.Path:
        return self.workdir(name) / SPECULATE_DIR / f"{setting_name(temperature, schedule)}.json"

    def run(self) -> dict:
        """Trains, calibrates and decodes every group that is not done; returns the suite record."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.record["environment"] = _environment()
        self._save()
        for group in self.groups:
            self._stage(group.name, "train", self._train, group)
        self._params()
        for group in self.groups:
            self._stage(group.name, "evaluate", self._evaluate, group)
        for group in self.groups:
            self._stage(group.name, "calibrate", self._calibrate, group)
        self._speculate_all()
        return self.record

    # ---- Stages ------------------------------------------------------------------------------------

    def _stage(self, name: str, stage: str, fn: Callable, *args) -> None:
        began = time.perf_counter()
        if fn(*args):
            seconds = self.record["stages"].setdefault(name, {})
            seconds[stage] = round(seconds.get(stage, 0.0) + time.perf_counter() - began, 1)
            self._save()

    def _train(self, group: plan.Group) -> bool:
        config, workdir = self.configs[group.name], self.workdir(group.name)
        summary = _read_json(workdir / SUMMARY_FILE)
        if summary and summary["step"] == config.train.stop_step:
            log.info("suite: %s trained (step %d), skipped", group.name, summary["step"])
            return False
        if group.continues and not (workdir / "checkpoints").exists():
            self._start_from_source(group)
        log.info("suite: training %s (%s) in %s", group.name, group.label, workdir)
        train(config, workdir)
        jax.clear_caches()
        return True

    def _start_from_source(self, group: plan.Group) -> None:
        """A same-budget row's work directory begins as a copy of its source's final checkpoint (state,
        iterator position, config) and metrics log, so that training resumes there as the source's run."""
        source, workdir = self.workdir(group.continues), self.workdir(group.name)
        step = str(self.configs[group.continues].train.stop_step)
        staging = workdir / "checkpoints.tmp"
        _copy_tree(source / "checkpoints" / step, staging / step)
        (source / METRICS_FILE).copy(workdir / METRICS_FILE, overwrite=True)
        staging.rename(workdir / "checkpoints")  # last: a copy cut short is redone on the next run
        log.info("suite: %s starts as a copy of %s at step %s", group.name, group.continues, step)

    def evaluation_file(self, name: str) -> epath.Path:
        """`<group>/evaluation/step_<N>.json` of the row's final checkpoint (`.npz` beside it)."""
        workdir = self.workdir(name)
        return workdir / EVALUATION_DIR / f"step_{checkpoints.checkpoint_step(workdir)}.json"

    def _picker(self) -> plan.Group | None:
        """The suite's row whose group picks its own prefixes (Draft Memory), if there is one."""
        pickers = [
            g
            for g in self.groups
            if not (g.continues or g.seed_offset) and registry.get(g.module).model.prefixes
        ]
        if len(pickers) > 1:
            names = [g.name for g in pickers]
            raise config_lib.UsageError(f"groups {names} all pick their own prefixes; a suite holds one")
        return pickers[0] if pickers else None

    def _evaluate(self, group: plan.Group) -> bool:
        """The final checkpoint on the validation cache: its own blocks, then the picker's prefixes. A row
        evaluated while its suite held no picker (a `--groups` run without Draft Memory) gains the
        same-prefix part on a later run that has one; its own-block part is kept."""
        path = self.evaluation_file(group.name)
        npz = path.parent / f"{path.stem}.npz"
        picker = self._picker()
        record = _read_json(path)
        if record is not None and (picker is None or "same_prefixes" in record):
            return False
        workdir = self.workdir(group.name)
        config = checkpoints.run_config(workdir)
        v = open_validation(config, workdir)
        if record is None:
            log.info("suite: evaluating %s on its own blocks", group.name)
            metrics, samples, ablated = measure_checkpoint(v)
            pretrained = config.init.step if registry.get(config.experiment).model.init_from else 0
            record = {"step": pretrained + v.step, "samples": v.samples, "own": metrics}  # cumulative
            arrays = {f"own/{k}": x for k, x in samples._asdict().items()}
            for name, sums in ablated.items():  # the same blocks without one input: `without_<name>/`
                arrays |= {f"without_{name}/{k}": x for k, x in sums._asdict().items()}
        else:
            with npz.open("rb") as f:
                arrays = dict(np.load(f))
        if picker is not None:
            log.info("suite: evaluating %s on the prefixes of %s", group.name, picker.name)
            picked = self.workdir(picker.name)
            prefixes = open_prefixes(v, checkpoints.run_config(picked), picked)
            if picker.name == group.name:  # its own blocks are the prefixes
                metrics = record["own"]
                same = {k.removeprefix("own/"): x for k, x in arrays.items() if k.startswith("own/")}
            else:
                metrics, samples, _ = measure_checkpoint(v, prefixes)
                same = samples._asdict()
            record["same_prefixes"] = {"group": picker.name, "step": prefixes.step, "metrics": metrics}
            arrays |= {f"same_prefixes/{k}": x for k, x in same.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        with npz.open("wb") as f:
            np.savez(f, **arrays)
        _write_json(path, record)  # last: its presence (with the picker's part, if any) marks the stage done
        jax.clear_caches()
        return True

    def _calibrate(self, group: plan.Group) -> bool:
        workdir = self.workdir(group.name)
        config = checkpoints.run_config(workdir)
        path = checkpoints.calibration_file(workdir, checkpoints.checkpoint_step(workdir))
        if path.exists():
            return False
        log.info("suite: calibrating the confidence head of %s", group.name)
        measure.calibrate_checkpoint(config, workdir)
        return True

    def _params(self) -> None:
        counts = {}
        for group in self.groups:
            config = self.configs[group.name]
            _, params, _ = draft_state.abstract_draft(
                config, TargetConfig.from_json(config.target.arch.to_dict())
            )
            counts[group.name] = sum(x.size for x in jax.tree.leaves(params))
        base = counts.get("baseline")
        _write_json(
            self.root / PARAMS_FILE,
            {
                name: {"parameters": n, "added": None if base is None else n - base}
                for name, n in counts.items()
            },
        )

    def _speculate_all(self) -> None:
        p = self.protocol
        todo = [
            (group, t, schedule)
            for group in self.groups
            for t, schedule in p.settings
            if not self.speculate_file(group.name, t, schedule).exists()
        ]
        if not todo:
            return
        first = checkpoints.run_config(self.workdir(self.groups[0].name))
        mesh = sharding.make_mesh(first.mesh.to_dict())
        target = target_from_config(first.target, seed=first.seed, mesh=mesh)
        conversations = read_turns_jsonl(GSM8K_VAL256)[: p.limit or None]
        for group, t, schedule in todo:
            self._stage(
                group.name,
                f"speculate_{setting_name(t, schedule)}",
                self._speculate,
                group,
                t,
                schedule,
                target,
                mesh,
                conversations,
            )

    def _speculate(self, group, temperature, schedule, target, mesh, conversations) -> bool:
        workdir = self.workdir(group.name)
        config = checkpoints.run_config(workdir)
        s = measure.DecodeSettings(
            temperature=temperature,
            seed=config.seed,
            max_new_tokens=self.protocol.max_new_tokens,
            concurrency=self.protocol.concurrency,
            schedule=schedule,
        )
        log.info("suite: speculative decoding with %s, %s", group.name, setting_name(temperature, schedule))
        decoder, step = measure.speculative_decoder(config, workdir, target, mesh, s)
        baseline_file = (
            self.root / TARGET_ONLY_DIR / "t{:g}-top_p{:g}-s{}-n{}-c{}.json".format(*s.target_only_key)
        )
        baseline = _read_json(baseline_file)
        if baseline is None:
            baseline = measure.target_only(decoder, target, conversations, s)
            _write_json(baseline_file, baseline)
        result = measure.speculate(
            decoder,
            step,
            config,
            target,
            conversations,
            s,
            input_name=str(GSM8K_VAL256),
            baseline=baseline,
            time_phases=self.protocol.time_phases,
        )
        result["target_only_file"] = str(baseline_file.relative_to(self.root))
        _write_json(self.speculate_file(group.name, temperature, schedule), result)
        jax.clear_caches()
        return True

    def _save(self) -> None:
        _write_json(self.root / SUITE_FILE, self.record)
