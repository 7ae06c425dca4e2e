"""Shared command-line plumbing: the `--config` flag of every entry point, validated before any work."""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags
from ml_collections import config_flags

from dspark_jax import config_lib
from dspark_jax.target.generate import SamplingParams
from dspark_jax.train.components import run_config

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = f"{REPO_ROOT / 'configs' / 'baseline.py'}:demo"


def define_config_flag(default: str | None = DEFAULT_CONFIG):
    """`--config=configs/<experiment>.py[:preset]` with `--config.key=value` overrides.

    `default=None` makes the flag optional (commands that read a run's stored config).
    Experiment configs import `configs.base`, so the repository root goes on `sys.path`.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return config_flags.DEFINE_config_file("config", default, "Experiment config file[:preset].")


def config_value(flag):
    """The flag's config, validated (a one-line error naming the key, before any expensive work)."""
    config = flag.value
    config_lib.validate(config)
    return config


def checkpoint_config(flag, checkpoint: str):
    """The config of the run in `checkpoint`: the stored one, or `--config` when given and consistent."""
    config = run_config(checkpoint, given=flag.value)
    config_lib.validate(config)
    return config


class SamplingFlags:
    """`--temperature`, `--top_p` and `--seed`, each overriding the config when given."""

    def __init__(self):
        self._temperature = flags.DEFINE_float("temperature", None, "Overrides config.generate.temperature.")
        self._top_p = flags.DEFINE_float("top_p", None, "Overrides config.generate.top_p.")
        self._seed = flags.DEFINE_integer("seed", None, "Overrides config.seed.")

    def resolve(self, config) -> tuple[SamplingParams, int]:
        """`(sampling, seed)` from the flags, falling back to `config.generate` and `config.seed`."""
        pick = lambda flag, default: default if flag.value is None else flag.value
        params = SamplingParams(
            temperature=pick(self._temperature, config.generate.temperature),
            top_p=pick(self._top_p, config.generate.top_p),
        )
        return params, pick(self._seed, config.seed)
