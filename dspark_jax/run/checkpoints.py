"""Orbax checkpoints: the train state, the grain iterator state and a JSON meta item.

One step directory per saved step, three items inside::

    <directory>/<step>/state      params + opt_state + step (orbax StandardSave, any sharding)
    <directory>/<step>/data_iter  the grain iterator state, one JSON file per process
    <directory>/<step>/meta       a small JSON dict (config, metrics step, ...)

`directory` may be a local path or `gs://...`. Restoring takes an abstract state
(`jax.ShapeDtypeStruct`s carrying shardings) so the arrays land sharded as requested,
whatever mesh they were saved from. Before reading, the saved tree is checked against the
abstract one and the first mismatching key path is named; dtypes may differ (orbax casts).

Usage::

    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)
    if (step := ckpt.latest_step()) is not None:
        state, meta = ckpt.restore(step, abstract_state, data_iter=it)
    ...
    ckpt.save(step, state, data_iter=it, meta={"config": config.to_dict()})
    ckpt.close()
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import grain
import grain.checkpoint
import jax
import orbax.checkpoint as ocp
from etils import epath

from dspark_jax.inference import calibration
from dspark_jax.interop.consumers import side_files
from dspark_jax.run import config_lib

_STATE, _DATA_ITER, _META = "state", "data_iter", "meta"

DataIterator = grain.DatasetIterator | grain.DataLoaderIterator


class Checkpointer:
    """A thin `ocp.CheckpointManager` over the `state`, `data_iter` and `meta` items.

    `save_interval_steps` makes `save` skip steps that are not a multiple of it, the
    first step of a run included, unless `force`; a step already saved is skipped too.
    `max_to_keep=None` keeps every step. `async_save=True` returns from `save` once the
    arrays are copied to host and writes them in the background (the iterator
    state and meta are written before `save` returns).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = False,
    ):
        # orbax wants absolute paths; a relative local one is taken against the working directory.
        self.directory = (
            epath.Path(directory) if "://" in os.fspath(directory) else epath.Path(directory).resolve()
        )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            # Exactly the multiples of the interval: no orbax initial save, and preemption
            # saves come from `PreemptionGuard` + `force=True`.
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(save_interval_steps),
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        handlers = {
            _STATE: ocp.StandardCheckpointHandler(),
            _DATA_ITER: grain.checkpoint.CheckpointHandler(),
            _META: ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The newest complete step in the directory, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete step in the directory, ascending."""
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_iter: DataIterator | None = None,
        meta: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves `state` (and the iterator, and `meta`) as `step`; returns whether it saved.

        Skips a step off `save_interval_steps` unless `force`, and a step that is already
        saved. `meta` must be JSON-serialisable.
        """
        if step in self._manager.all_steps():
            return False
        items: dict[str, ocp.args.CheckpointArgs] = {
            _STATE: ocp.args.StandardSave(state),
            _META: ocp.args.JsonSave(dict(meta or {})),
        }
        if data_iter is not None:
            items[_DATA_ITER] = grain.checkpoint.CheckpointSave(data_iter)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(
        self, step: int | None, abstract_state: Any, *, data_iter: DataIterator | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Restores `step` (None: the latest) into the layout of `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s (with shardings) or arrays
        shaped like the saved state. `data_iter`, when given, is set in place to the saved
        iterator position. Returns `(state, meta)`.
        """
        step = self._existing_step(step)
        saved = self._manager.item_metadata(step)
        _check_matches(saved[_STATE], abstract_state, where=self.directory / str(step))
        items: dict[str, ocp.args.CheckpointArgs] = {
            _STATE: ocp.args.StandardRestore(abstract_state),
            _META: ocp.args.JsonRestore(),
        }
        if data_iter is not None:
            if _DATA_ITER not in saved:
                raise ValueError(f"checkpoint {self.directory / str(step)} holds no data iterator state")
            items[_DATA_ITER] = grain.checkpoint.CheckpointRestore(data_iter)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored[_STATE], dict(restored[_META] or {})

    def has_data_iter(self, step: int | None = None) -> bool:
        """Whether `step` (None: the latest) holds a data iterator state (an imported checkpoint has none)."""
        return _DATA_ITER in self._manager.item_metadata(self._existing_step(step))

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON meta item of `step` (None: the latest), without reading any array."""
        step = self._existing_step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
        return dict(restored[_META] or {})

    def restore_params(self, step: int | None, abstract_params: Any) -> Any:
        """Only `state['params']` of `step`, into the layout of `abstract_params` (no optimizer state)."""
        step = self._existing_step(step)
        saved = self._manager.item_metadata(step)[_STATE]
        _check_matches(saved["params"], abstract_params, where=self.directory / str(step))
        restored = ocp.PyTreeCheckpointer().restore(
            self.directory / str(step) / _STATE,
            args=ocp.args.PyTreeRestore(
                item={"params": abstract_params},
                restore_args=ocp.checkpoint_utils.construct_restore_args({"params": abstract_params}),
                partial_restore=True,
            ),
        )
        return restored["params"]

    def _existing_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory} (saved: {self.all_steps()})"
            )
        return step

    def wait(self) -> None:
        """Blocks until a background save has finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """`{'params.layer.kernel': shape}` for every leaf of `tree` (arrays or metadata)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): tuple(getattr(leaf, "shape", ()))
        for path, leaf in leaves
    }


def _check_matches(saved_metadata: Any, abstract_state: Any, *, where: epath.Path) -> None:
    """Raises a ValueError naming every key path the saved tree lacks or adds, or the first whose shape
    differs (a checkpoint of another experiment group or draft shape)."""
    saved = _flat_shapes(saved_metadata)
    target = _flat_shapes(abstract_state)
    missing = [name for name in target if name not in saved]
    extra = [name for name in saved if name not in target]
    resized = [
        f"{name!r} has shape {saved[name]} in the checkpoint but {shape} in the model"
        for name, shape in target.items()
        if name in saved and saved[name] != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in the model: {', '.join(extra)}")
    if resized:
        problems.append(resized[0])
    if problems:
        raise ValueError(
            f"checkpoint {where} does not match the model/optimizer being restored: {'; '.join(problems)} "
            f"(saved by a different config or experiment group? use its own config or a fresh directory)"
        )


log = logging.getLogger(__name__)


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


def calibration_file(checkpoint: str | os.PathLike, step: int) -> epath.Path:
    """The STS calibration file of checkpoint `step` of the run that `checkpoint` names (beside its
    checkpoints directory: `<workdir>/calibration/step_<step>/sts.json`)."""
    return calibration.calibration_path(resolve_checkpoint(checkpoint)[0].parent, step)


def sps_table_file(checkpoint: str | os.PathLike) -> epath.Path:
    """The serving SPS table profiled for the run that `checkpoint` names (the target's on one device,
    whatever the step; `python -m dspark_jax.calibrate --profile_sps`):
    `<workdir>/calibration/sps_table.json`."""
    return epath.Path(resolve_checkpoint(checkpoint)[0].parent) / "calibration" / side_files.SPS_FILE


def load_calibration(
    checkpoint: str | os.PathLike, step: int, block_size: int
) -> dict[str, tuple[float, ...]]:
    """The STS temperatures of every mode for checkpoint `step`; a clear error when it was never fitted."""
    path = calibration_file(checkpoint, step)
    if not path.exists():
        raise config_lib.UsageError(
            f"--schedule=confidence needs the STS calibration of step {step} ({path} is missing): run "
            f"python -m dspark_jax.calibrate --checkpoint={checkpoint} first"
        )
    return {mode: calibration.load_temperatures(path, mode, block_size) for mode in calibration.MODES}


def run_config(checkpoint: str | os.PathLike, given=None):
    """The config a run was trained with, read from its checkpoint metadata.

    With `given` (a `--config`), that config is used instead, after checking that it agrees with
    the stored one on every shape-bearing key.
    """
    directory, step = resolve_checkpoint(checkpoint)
    with Checkpointer(directory) as checkpointer:
        stored = checkpointer.meta(step).get("config")
    where = str(directory)
    if stored is None and given is None:
        raise ValueError(f"checkpoint {where} stores no config (an older run?): pass --config")
    if stored is None:
        return given
    if given is None:
        return config_lib.from_stored(stored)
    config_lib.check_same_shape(given, stored, where)
    return given


def checkpoint_step(checkpoint: str | os.PathLike) -> int:
    """The step `checkpoint` names: the given step's directory, else the latest checkpoint."""
    directory, step = resolve_checkpoint(checkpoint)
    if step is None:
        with Checkpointer(directory) as checkpointer:
            step = checkpointer.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    return step
