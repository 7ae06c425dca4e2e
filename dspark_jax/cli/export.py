"""Export a trained draft for the serving engines (DeepSpec's checkpoint layout), or check an exported one.

  python -m dspark_jax.export --checkpoint=DIR --output=OUT [--for=all|vllm,sglang,trtllm]
      [--sts_mode=greedy|sampling] [--baseline_part] [--config=configs/baseline.py[:preset]]
  python -m dspark_jax.export --check=OUT [--for=...]

`--checkpoint` takes a training work directory (its latest checkpoint), a checkpoints directory, or
one step's directory; the run's stored config is used unless `--config` is given (it must agree with
the stored one on every key that shapes the draft). Writes `OUT/model.safetensors` (the draft under
DeepSpec's parameter names and torch layouts, plus the target's embedding and LM head as DeepSpec's
drafts carry them) and `OUT/config.json` (the target's config with DeepSpec's draft keys): the
directory DeepSpec's `Qwen3DSparkModel.from_pretrained`, vLLM and SGLang read. `--for` adds each engine's
own files (`dspark_jax/interop/engines.py`): for SGLang the STS calibration of the checkpoint's step
(`--sts_mode` picks greedy or sampled acceptance) and the run's profiled SPS table, each when made
(`python -m dspark_jax.calibrate [--profile_sps]`); for TensorRT-LLM its `speculative_config` options
file. The directory is then checked against every engine's loader, as `--check` does for any directory
(DeepSpec's released drafts too): one line per problem, exit 1 when there is one.

Only a draft with a target row as MASK (`draft.mask_token_id`) exports. A group whose own parameters no
engine runs is refused, naming what each engine would need; `--baseline_part` exports the baseline DSpark
draft inside it alone and records that in `config.json` (`dspark_jax.baseline_part_only`).
"""

from __future__ import annotations

from pathlib import Path

from absl import flags

from dspark_jax.cli.common import check_flags, checkpoint_config, define_config_flag, define_path_flag, run
from dspark_jax.inference import calibration
from dspark_jax.interop import engines
from dspark_jax.run.deepspec_checkpoint import export_draft

_CONFIG = define_config_flag(default=None)
_CHECKPOINT = define_path_flag("checkpoint", None, "Work directory or checkpoint directory.")
_OUTPUT = define_path_flag("output", None, "New directory for the exported draft.")
_CHECK = define_path_flag("check", None, "Check this exported directory instead of exporting.")
_FOR = flags.DEFINE_string("for", "all", f"Serving engines: 'all' or a comma list of {engines.ENGINES}.")
_STS_MODE = flags.DEFINE_enum("sts_mode", "greedy", calibration.MODES, "Acceptance the STS file calibrates.")
_BASELINE_PART = flags.DEFINE_bool(
    "baseline_part", False, "Export only the baseline DSpark draft of a group with parameters of its own."
)


def main(argv):
    del argv
    try:
        for_engines = engines.parse_engines(_FOR.value)
    except ValueError as e:
        check_flags(**{"for": (False, f"is wrong: {e}")})
    if _CHECK.value:
        check_flags(
            checkpoint=(_CHECKPOINT.value is None, "is not used with --check"),
            output=(_OUTPUT.value is None, "is not used with --check"),
        )
        directory = Path(_CHECK.value)
    else:
        check_flags(
            checkpoint=(_CHECKPOINT.value is not None, "is required (or --check=DIR)"),
            output=(_OUTPUT.value is not None, "is required (or --check=DIR)"),
        )
        output = Path(_OUTPUT.value)
        fresh = not output.exists() or (output.is_dir() and not any(output.iterdir()))
        check_flags(output=(fresh, f"must be a new or empty directory ({output} is not)"))
        config = checkpoint_config(_CONFIG, _CHECKPOINT.value)
        directory = export_draft(
            config,
            _CHECKPOINT.value,
            output,
            for_engines=for_engines,
            baseline_part=_BASELINE_PART.value,
            sts_mode=_STS_MODE.value,
        )
        files = sorted(p.name for p in directory.iterdir())
        print(f"wrote {directory}: {', '.join(files)}")  # export_draft checked it already
        print(f"{directory} loads in {', '.join(for_engines)} (checked against their loaders' expectations)")
        return
    problems = engines.check_directory(directory, for_engines)
    for line in problems:
        print(line)
    if problems:
        raise ValueError(f"{directory}: {len(problems)} problems for {', '.join(for_engines)} (listed above)")
    print(f"{directory} loads in {', '.join(for_engines)} (checked against their loaders' expectations)")


def launch() -> None:
    """The command: flags parsed, errors as one line (`cli.common.run`)."""
    run(main, config_default=None)


if __name__ == "__main__":
    launch()
