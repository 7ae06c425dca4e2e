"""Export a trained draft for its consumers (serving engines, trainers, DeepSpec), or check an exported one.

  python -m dspark_jax.export --checkpoint=DIR --output=OUT [--for=all|deepspec,vllm,sglang,...]
      [--sts_mode=greedy|sampling] [--baseline_part] [--config=configs/baseline.py[:preset]]
  python -m dspark_jax.export --check=OUT [--for=...]

`--checkpoint` takes a training work directory (its latest checkpoint), a checkpoints directory, or
one step's directory; the run's stored config is used unless `--config` is given (it must agree with
the stored one on every key that shapes the draft). `OUT` is DeepSpec's draft directory
(`config.json`, `model.safetensors`: the draft under DeepSpec's names plus the target's embedding and LM
head), which DeepSpec, vLLM, SGLang, TensorRT-LLM and sglang-jax read; a draft trained with a draft
vocabulary is written in vLLM's `d2t` form. Consumers whose loaders want another config get their own
directory below it: `OUT/specforge/` (SpecForge) and `OUT/speculators/` (vllm-project's speculators).
SGLang also gets the STS calibration of the checkpoint's step (`--sts_mode` picks greedy or sampled
acceptance) and the run's profiled SPS table, each when made (`python -m dspark_jax.calibrate
[--profile_sps]`); TensorRT-LLM its `speculative_config` options file. Every directory is then checked
against its consumer's loader (`dspark_jax/interop/consumers/`, each rule citing the consumer's code), as
`--check` does for any directory (DeepSpec's released drafts too): one line per problem, exit 1 when
there is one.

`--for=all` exports for every consumer that can run the draft and names those that cannot (a draft
vocabulary: only vLLM and speculators map one); a consumer named in `--for` that cannot run it is an
error naming why and what would make it work, before anything is written. Only a draft with a target row
as MASK (`draft.mask_token_id`) exports. A group whose own parameters no engine runs is refused, naming
what each engine would need; `--baseline_part` exports the baseline DSpark draft inside it alone and
records that in `config.json` (`dspark_jax.baseline_part_only`).
"""

from __future__ import annotations

from pathlib import Path

from absl import flags

from dspark_jax.cli import check_flags, checkpoint_config, define_config_flag, define_path_flag, run
from dspark_jax.inference import calibration
from dspark_jax.interop import consumers
from dspark_jax.run.deepspec_checkpoint import export_draft

_CONFIG = define_config_flag(default=None)
_CHECKPOINT = define_path_flag("checkpoint", None, "Work directory or checkpoint directory.")
_OUTPUT = define_path_flag("output", None, "New directory for the exported draft.")
_CHECK = define_path_flag("check", None, "Check this exported directory instead of exporting.")
_FOR = flags.DEFINE_string("for", "all", f"Consumers: 'all' or a comma list of {tuple(consumers.CONSUMERS)}.")
_STS_MODE = flags.DEFINE_enum("sts_mode", "greedy", calibration.MODES, "Acceptance the STS file calibrates.")
_BASELINE_PART = flags.DEFINE_bool(
    "baseline_part", False, "Export only the baseline DSpark draft of a group with parameters of its own."
)


def main(argv):
    del argv
    try:
        names = consumers.parse(_FOR.value)
    except ValueError as e:
        check_flags(**{"for": (False, f"is wrong: {e}")})
    if _CHECK.value:
        check_flags(
            checkpoint=(_CHECKPOINT.value is None, "is not used with --check"),
            output=(_OUTPUT.value is None, "is not used with --check"),
        )
        directory = Path(_CHECK.value)
        problems = consumers.check_directory(directory, names)
        for line in problems:
            print(line)
        if problems:
            raise ValueError(f"{directory}: {len(problems)} problems for {', '.join(names)} (listed above)")
        print(f"{directory} loads in {', '.join(names)} (checked against their loaders' rules)")
        return
    check_flags(
        checkpoint=(_CHECKPOINT.value is not None, "is required (or --check=DIR)"),
        output=(_OUTPUT.value is not None, "is required (or --check=DIR)"),
    )
    output = Path(_OUTPUT.value)
    fresh = not output.exists() or (output.is_dir() and not any(output.iterdir()))
    check_flags(output=(fresh, f"must be a new or empty directory ({output} is not)"))
    config = checkpoint_config(_CONFIG, _CHECKPOINT.value)
    directory, chosen, refused = export_draft(
        config,
        _CHECKPOINT.value,
        output,
        consumers_text=_FOR.value,
        baseline_part=_BASELINE_PART.value,
        sts_mode=_STS_MODE.value,
    )
    for name in chosen:
        where = consumers.directory_of(directory, name)
        print(f"{name}: {where} ({', '.join(sorted(p.name for p in where.iterdir() if p.is_file()))})")
    for name, why in refused.items():
        print(f"{name}: not exported: {why}")
    print(f"{directory} loads in {', '.join(chosen)} (checked against their loaders' rules)")


if __name__ == "__main__":
    run(main, config_default=None)
