"""Shared command-line plumbing: the `--config` flag of every entry point."""

from __future__ import annotations

import sys
from pathlib import Path

from ml_collections import config_flags

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = f"{REPO_ROOT / 'configs' / 'baseline.py'}:demo"


def define_config_flag(default: str = DEFAULT_CONFIG):
    """`--config=configs/<experiment>.py[:preset]` with `--config.key=value` overrides.

    Experiment configs import `configs.base`, so the repository root goes on `sys.path`.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return config_flags.DEFINE_config_file("config", default, "Experiment config file[:preset].")
