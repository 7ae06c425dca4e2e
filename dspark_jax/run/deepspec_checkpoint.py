"""A trained draft to and from DeepSpec's checkpoint layout (`dspark_jax.interop.deepspec_layout`).

`export_draft` writes a project checkpoint's draft as a DeepSpec directory: the draft's tensors under
DeepSpec's names plus the target's frozen embedding and LM head (which every DeepSpec draft carries, so
that `Qwen3DSparkModel.from_pretrained` finds all of its weights), and `config.json` built from the
target's config. `import_draft` reads such a directory into a new work directory as step 0 of a run of
the given config: orbax, the layout training writes (parameters, a fresh optimizer state, the stored
config in the meta item), so `evaluate` and `speculate` take it like a trained run, and a group that
starts from a baseline run (`Experiment.model.init_from`) starts from it (`init.checkpoint` = that work
directory, `init.step=0`). Both check everything (the group's parameter names, the config, every
tensor's name and shape) before writing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import groups, sharding
from dspark_jax.inference import calibration
from dspark_jax.interop import consumers
from dspark_jax.interop import deepspec_layout as layout
from dspark_jax.run import checkpoints, config_lib, draft_state, target_side
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.run.checkpoints import Checkpointer
from dspark_jax.target import TargetConfig, target_from_config
from dspark_jax.target.checkpoint import default_target_path, load_checkpoint

log = logging.getLogger(__name__)


def _target_path(config) -> Path:
    return Path(config.target.path) if config.target.path else default_target_path()


def target_shape(config) -> TargetConfig:
    """The config's target shape, without reading any weight."""
    if config.target.random_init:
        return TargetConfig.from_json(config.target.arch.to_dict())
    return load_checkpoint(_target_path(config)).config


def target_tensors(config, mesh) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The target's Hugging Face config dict and its DeepSpec tensors `embed_tokens.weight` and
    `lm_head.weight` (`[V, H]`, in `target.dtype`, the values training reads)."""
    dtype = jnp.dtype(config.target.dtype)
    if config.target.random_init:
        model = target_from_config(config.target, seed=config.seed, mesh=mesh).model
        hf_config = layout.hf_target_config(model.cfg)
        embedding_VxH, lm_head_VxH = model.embedding.get_value(), model.lm_head_matrix().T
    else:
        path = _target_path(config)
        ckpt = load_checkpoint(path)
        hf_config = (
            json.loads((path / layout.CONFIG_FILE).read_text())
            if path.is_dir()
            else layout.hf_target_config(ckpt.config)
        )
        embedding_VxH = ckpt.read("model.embed_tokens.weight")
        lm_head_VxH = embedding_VxH if ckpt.config.tie_word_embeddings else ckpt.read("lm_head.weight")
    tensors = dict(zip(layout.TARGET_TENSORS, (embedding_VxH, lm_head_VxH)))
    return hf_config, {name: np.asarray(jax.device_get(x)).astype(dtype) for name, x in tensors.items()}


def _flat(state: nnx.State) -> dict[layout.ParamPath, Any]:
    return {path: variable.get_value() for path, variable in nnx.to_flat_state(state)}


def _placed(abstract: nnx.State, values: dict[layout.ParamPath, np.ndarray]) -> nnx.State:
    """The parameters `abstract` (with shardings) holding `values` by path, in their dtypes and shardings."""

    def one(path, variable):
        like = variable.get_value()
        return path, variable.replace(jax.device_put(values[path].astype(like.dtype), like.sharding))

    return nnx.from_flat_state([one(path, variable) for path, variable in nnx.to_flat_state(abstract)])


def _left_out(config, cfg, shapes: dict[layout.ParamPath, tuple[int, ...]], named, baseline_part: bool):
    """The group's own parameters (not in `named`, the DeepSpec layout's paths: no engine has them),
    grouped by module; refuses them unless `baseline_part`. A learned MASK vector is refused either way
    (it is the baseline's MASK)."""
    if ("mask_embedding",) in shapes:  # refused whatever the group: names the learned MASK and the fix
        layout.check_exportable(
            {p: x for p, x in shapes.items() if p in named or p == ("mask_embedding",)},
            cfg,
            config.experiment,
        )
    layout.check_exportable({p: x for p, x in shapes.items() if p in named}, cfg, config.experiment)
    extra = sorted({str(p[0]) + (".*" if len(p) > 1 else "") for p in shapes if p not in named})
    if not extra:
        return []
    gap = groups.get(config.experiment).run.serving_gap or "code for them (the group names no serving_gap)"
    if not baseline_part:
        raise ValueError(
            f"experiment group {config.experiment!r}: parameters {', '.join(extra)} run in no serving "
            "engine: vLLM (Qwen3DSparkForCausalLM), SGLang (Qwen3DSparkModel) and TensorRT-LLM (DSpark) "
            f"would need {gap}; pass --baseline_part to export the "
            "baseline DSpark draft inside it alone (recorded in config.json)"
        )
    log.warning("exporting the baseline part of %s alone: %s left out", config.experiment, ", ".join(extra))
    return extra


def _calibration(config, record: dict, mode: str) -> consumers.Calibration:
    """The run's calibration record of a step (`python -m dspark_jax.calibrate`), of acceptance `mode`."""
    held_out = record["ece"][mode]["held_out"]
    return consumers.Calibration(
        mode=mode,
        dataset=config.data.val_source or "gsm8k_val256",
        num_samples=record["blocks"]["fit"],
        temperatures=tuple(record["temperatures"][mode]),
        ece_before=tuple(held_out["before"]),
        ece_after=tuple(held_out["after"]),
        survival=_mean_survival(record, mode),
    )


def _mean_survival(calibration_record: dict, mode: str) -> tuple[float, ...]:
    """Per position, the measured cumulative acceptance over the held-out blocks (the reliability bins')."""
    out = []
    for bins in calibration_record["reliability"][mode]["held_out"]["after"]:
        pairs = [(n, a) for n, a in zip(bins["count"], bins["accuracy"]) if n]
        out.append(sum(n * a for n, a in pairs) / max(1, sum(n for n, _ in pairs)))
    return tuple(out)


def _side_sources(config, checkpoint, step: int, config_json: dict, directory: Path, sts_mode: str):
    """What the consumers' side files are made from: the run's calibration of `step` (of `sts_mode`) and its
    SPS table, each as far as made (`python -m dspark_jax.calibrate [--profile_sps]`)."""
    sts_path, sps_path = (
        checkpoints.calibration_file(checkpoint, step),
        checkpoints.sps_table_file(checkpoint),
    )
    read = lambda path: json.loads(path.read_text()) if path.exists() else None
    record, calibrate = read(sts_path), f"python -m dspark_jax.calibrate --checkpoint={checkpoint}"
    return consumers.SideSources(
        directory=directory.resolve(),
        config_json=config_json,
        step=step,
        experiment=config.experiment,
        calibration=consumers.RunFile(
            str(sts_path), None if record is None else _calibration(config, record, sts_mode), calibrate
        ),
        sps_table=consumers.RunFile(
            str(sps_path), read(sps_path), calibrate + " --profile_sps (on the serving machine)"
        ),
    )


def export_draft(
    config,
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    consumers_text: str = "all",
    baseline_part: bool = False,
    sts_mode: str = "greedy",
) -> tuple[Path, tuple[str, ...], dict[str, str]]:
    """Writes the draft of `checkpoint` (trained with `config`) for the consumers `consumers_text` names
    ('all' or a comma list, `interop.consumers`): `output` in DeepSpec's layout (with a draft vocabulary,
    vLLM's `d2t` form), a directory of their own below it for the consumers that want one, the engines'
    side files; then checks every directory against its consumer's loader. Returns the directory, the
    consumers written for and `{consumer: why not}` for those 'all' left out.

    Everything that can refuse the export does before anything is written: a consumer that cannot run the
    draft (named consumers must all run it), a group with parameters of its own (its `serving_gap` named)
    unless `baseline_part`: then the baseline DSpark draft inside it is written alone, recorded under
    `dspark_jax` in `config.json`."""
    if sts_mode not in calibration.MODES:
        raise ValueError(f"STS mode must be one of {calibration.MODES}, got {sts_mode!r}")
    target = target_shape(config)
    cfg = draft_state.draft_config(config, target)
    _, abstract, _ = draft_state.abstract_draft(config, target)
    named = {t.path for t in layout.tensor_layout(cfg).values()}
    shapes = {p: x.shape for p, x in _flat(abstract).items()}
    left_out = _left_out(config, cfg, shapes, named, baseline_part)
    aux_ids = tuple(config.data.aux_layer_ids)
    vocab = config.train.get("draft_vocab", 0) or None
    facts = consumers.DraftFacts(target.num_layers, aux_ids, target.vocab_size, vocab)
    chosen, refused = consumers.choose(consumers_text, facts)
    for name, why in refused.items():
        log.info("not exported for %s: %s", name, why)
    mesh = sharding.make_mesh(config.mesh.to_dict())
    ids_K = draft_vocabulary(config, mesh)

    hf_config, tensors = target_tensors(config, mesh)
    _, params, _, step = draft_state.restore_draft(config, target, mesh, checkpoint)
    config_json = layout.deepspec_config(
        hf_config,
        cfg,
        num_target_layers=target.num_layers,
        target_layer_ids=aux_ids,
        num_anchors=config.train.num_anchors,
        dtype=cfg.param_dtype,
    ) | {
        "dspark_jax": {
            "experiment": config.experiment,
            "step": step,
            "baseline_part_only": bool(left_out),
            "left_out": left_out,
        }
    }
    host = {path: np.asarray(jax.device_get(x)) for path, x in _flat(params).items() if path in named}
    tensors |= layout.to_deepspec(host, cfg, config.experiment)
    if ids_K is not None:
        config_json, tensors = consumers.with_draft_vocabulary(config_json, tensors, ids_K)
    directory = layout.write_directory(output, config_json, tensors)
    sources = _side_sources(config, checkpoint, step, config_json, directory, sts_mode)
    consumers.write_own(directory, chosen, config_json, tensors, sources)
    problems = consumers.check_directory(directory, chosen)
    if problems:
        raise ValueError(f"{directory} would not load: " + "; ".join(problems))
    log.info(
        "exported step %d of %s to %s (%d tensors) for %s", step, checkpoint, directory, len(tensors), chosen
    )
    return directory, chosen, refused


def draft_vocabulary(config, mesh) -> np.ndarray | None:
    """The token ids a draft trained with `train.draft_vocab` proposes from (the run's training cache's
    most used, `target_side.training_vocabulary`), sorted; None for a whole-vocabulary draft."""
    size = config.train.get("draft_vocab", 0)
    if not size:
        return None
    side = (
        target_side.side_from_target(target_side.load_run_target(config, mesh), mesh)
        if config.target.random_init
        else target_side.side_from_checkpoint(config, mesh)
    )
    return np.sort(target_side.training_vocabulary(config, side, size))


def import_draft(config, directory: str | os.PathLike, workdir: str | os.PathLike) -> Path:
    """Reads the draft `directory` into `workdir` as step 0 of a `config` run; returns the checkpoints
    directory. `directory` is DeepSpec's layout, or a SpecForge or speculators DSpark draft in their own
    forms (`consumers.as_deepspec`; the tensors' names are DeepSpec's in all three, the target's embedding
    and LM head are the config's target's). The config must describe the same draft (checked key by key
    first); a draft vocabulary is refused (the project's is the run's training text's, not the file's)."""
    directory = Path(directory)
    source, config_json = consumers.as_deepspec(layout.read_config(directory))
    target = target_shape(config)
    if config_json.get("num_target_layers") is None:  # speculators records no target depth
        config_json["num_target_layers"] = target.num_layers
    size = config_json.get("draft_vocab_size") or config_json.get("vocab_size")
    if size != config_json.get("vocab_size"):
        raise ValueError(
            f"{directory}: a draft vocabulary of {size} tokens ({source}'s form): import takes drafts over "
            "the whole vocabulary"
        )
    cfg = draft_state.draft_config(config, target)
    layout.check_config(
        config_json,
        cfg,
        num_target_layers=target.num_layers,
        target_layer_ids=config.data.aux_layer_ids,
        source=str(directory / layout.CONFIG_FILE),
    )
    _, abstract, _ = draft_state.abstract_draft(config, target)
    layout.check_exportable({p: x.shape for p, x in _flat(abstract).items()}, cfg, config.experiment)
    layout.check_tensors(layout.tensor_shapes(directory), cfg, str(directory))
    names = list(layout.tensor_layout(cfg))
    values = layout.from_deepspec(layout.read_tensors(directory, names), cfg, str(directory))

    mesh = sharding.make_mesh(config.mesh.to_dict())
    params = _placed(sharding.with_shardings(abstract, mesh, config_lib.sharding_rules(config)), values)
    _, optimizer = optimizer_lib.make_training_optimizer(
        config, params, draft_state.copied_mask(config, target)
    )
    state = {"params": params, "opt_state": optimizer_lib.init_optimizer_state(optimizer, params, mesh)}
    meta = {
        "step": 0,
        "config": config_lib.to_stored(config),
        "pretrained_steps": 0,
        "imported_from": str(directory),
        "imported_form": source,
    }
    with Checkpointer(Path(workdir) / "checkpoints", max_to_keep=config.train.max_to_keep) as checkpointer:
        checkpointer.save(0, state, meta=meta, force=True)
        log.info("imported %s into %s as step 0", directory, checkpointer.directory)
        return checkpointer.directory
