"""What the benchmark scripts share: experiment configs by file (scripts put the repository on `sys.path`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_config_module(path: str) -> ModuleType:
    """An experiment config file (`configs/<name>.py`, relative to the repository or absolute) as a module
    with `get_config(preset)`."""
    file = Path(path) if Path(path).is_absolute() else ROOT / path
    if not file.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    spec = importlib.util.spec_from_file_location(f"configs.{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
