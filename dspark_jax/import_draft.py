"""Import a DeepSpec-trained DSpark draft as a project checkpoint, to evaluate it here or train it on.

  python -m dspark_jax.import_draft --input=DIR --config=configs/baseline.py[:preset] --workdir=OUT \
      [--config.key=value ...]

`DIR` is a DeepSpec draft directory (`config.json` + `model.safetensors` or an index and its shards,
as DeepSpec's training writes it, or `python -m dspark_jax.export`). The config must describe that
draft: every `config.json` key that shapes it (layers, heads, head and FFN widths, block size, aux
layers, Markov rank, MASK row, and the target's hidden size, vocabulary, layer count, norm epsilon and
RoPE base) is compared and each mismatch named with the override that fixes it, and every tensor is
checked by name and shape, before anything is written. `OUT` must not hold checkpoints yet; it
receives step 0 (parameters, a fresh optimizer state, the config) in the layout training writes, so
`python -m dspark_jax.evaluate --checkpoint=OUT` and `python -m dspark_jax.speculate --checkpoint=OUT`
take it. The target's `embed_tokens` and `lm_head` in `DIR` are checked for shape, not read: the
draft uses the config's target.
"""

from __future__ import annotations

from pathlib import Path

from dspark_jax.cli import check_flags, config_value, define_config_flag, define_path_flag, run
from dspark_jax.run.deepspec_checkpoint import import_draft

_INPUT = define_path_flag(
    "input", None, "DeepSpec draft directory (config.json, model.safetensors).", required=True
)
_CONFIG = define_config_flag(default=None)
_WORKDIR = define_path_flag("workdir", None, "New work directory for the imported checkpoint.", required=True)


def main(argv):
    del argv
    workdir = Path(_WORKDIR.value)
    check_flags(
        config=(
            _CONFIG.value is not None,
            "is required: the config of the imported draft (e.g. configs/baseline.py)",
        ),
        workdir=(
            not (workdir / "checkpoints").exists(),
            f"must be a new work directory ({workdir} holds checkpoints)",
        ),
    )
    checkpoints = import_draft(config_value(_CONFIG), _INPUT.value, workdir)
    print(f"wrote step 0 to {checkpoints}; next: python -m dspark_jax.evaluate --checkpoint={workdir}")


if __name__ == "__main__":
    run(main, config_default=None)
