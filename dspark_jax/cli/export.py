"""Export a trained draft in DeepSpec's checkpoint layout (Hugging Face `save_pretrained` style).

  python -m dspark_jax.export --checkpoint=DIR --output=OUT [--config=configs/baseline.py[:preset]]

`--checkpoint` takes a training work directory (its latest checkpoint), a checkpoints directory, or
one step's directory; the run's stored config is used unless `--config` is given (it must agree with
the stored one on every key that shapes the draft). Writes `OUT/model.safetensors` (the draft under
DeepSpec's parameter names and torch layouts, plus the target's embedding and LM head as DeepSpec's
drafts carry them) and `OUT/config.json` (the target's config with DeepSpec's draft keys): the
directory DeepSpec's `Qwen3DSparkModel.from_pretrained` reads. Only the baseline draft with a target
row as MASK (`draft.mask_token_id`) has a DeepSpec form; other drafts are refused, naming the
parameters DeepSpec has no name for. The name table: `dspark_jax/draft/deepspec_layout.py`.
"""

from __future__ import annotations

from pathlib import Path

from dspark_jax.cli.common import check_flags, checkpoint_config, define_config_flag, define_path_flag, run
from dspark_jax.run.deepspec_checkpoint import export_draft

_CONFIG = define_config_flag(default=None)
_CHECKPOINT = define_path_flag("checkpoint", None, "Work directory or checkpoint directory.", required=True)
_OUTPUT = define_path_flag(
    "output", None, "New directory for config.json and model.safetensors.", required=True
)


def main(argv):
    del argv
    output = Path(_OUTPUT.value)
    fresh = not output.exists() or (output.is_dir() and not any(output.iterdir()))
    check_flags(output=(fresh, f"must be a new or empty directory ({output} is not)"))
    directory = export_draft(checkpoint_config(_CONFIG, _CHECKPOINT.value), _CHECKPOINT.value, output)
    print(f"wrote {directory} (DeepSpec Qwen3DSparkModel: config.json, model.safetensors)")


def launch() -> None:
    """The command: flags parsed, errors as one line (`cli.common.run`)."""
    run(main, config_default=None)


if __name__ == "__main__":
    launch()
