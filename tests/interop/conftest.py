"""The exports every consumer test reads, made once a test process (`tests.interop.exports`)."""

import pytest

from tests.interop import exports


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """A smoke baseline draft exported for every consumer."""
    return exports.make_export(tmp_path_factory.mktemp("baseline_export"))


@pytest.fixture(scope="session")
def memory(tmp_path_factory):
    """Draft Memory's baseline part (`--baseline_part`), exported for every consumer."""
    return exports.memory_export(tmp_path_factory.mktemp("memory_export"))


@pytest.fixture(scope="session")
def vocab(tmp_path_factory):
    """A draft over the smoke run's DRAFT_VOCAB most used tokens: the main directory in vLLM's d2t form and
    speculators' directory (the consumers that map no draft vocabulary are left out, named)."""
    return exports.make_export(tmp_path_factory.mktemp("vocab_export"), draft_vocab=exports.DRAFT_VOCAB)
