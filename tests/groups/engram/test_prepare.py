"""The Engram config checks: the leakage guard, the draft's view of the table, a table that cannot be had."""

import json

import pytest

from configs import engram_markov, engram_mask_gated
from dspark_jax.data.conversations import GSM8K_VAL256
from dspark_jax.errors import UsageError
from dspark_jax.groups.engram import prepare
from dspark_jax.run import config_lib


def _config(**engram):
    config = engram_markov.get_config("smoke")
    with config.unlocked():
        for key, value in engram.items():
            config.engram[key] = value
    return config


def test_shipped_configs_pass():
    for module in (engram_markov, engram_mask_gated):
        for preset in ("paper", "demo", "smoke"):
            config_lib.validate(module.get_config(preset))
    paper = engram_markov.get_config("paper")
    assert paper.draft.engram_dim == 2560 and engram_markov.get_config("demo").draft.engram_dim == 576


@pytest.mark.parametrize(
    "engram, data, message",
    [
        ({"fit_offset": 0}, {}, "engram.fit_offset=0 overlaps the training text \\(conversations \\[0, 6\\)"),
        ({"fit_offset": 5}, {}, "set engram.fit_offset >= 6"),
        ({}, {"train_limit": 0}, "which training uses whole"),
        ({"fit_source": str(GSM8K_VAL256)}, {}, "is the validation source"),
    ],
)
def test_a_fit_that_overlaps_training_or_validation_is_refused(engram, data, message):
    config = _config(**engram)
    with config.unlocked():
        for key, value in data.items():
            config.data[key] = value
    with pytest.raises(UsageError, match=message):
        config_lib.validate(config)


def test_fit_conversations_leave_out_shared_prompts(tmp_path):
    """A fit file that repeats a training prompt: that conversation is left out, the rest kept."""
    turns = lambda text: [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]
    train = [{"conversations": turns(f"train question {i}")} for i in range(4)]
    fit_records = [{"conversations": turns(t)} for t in ("fresh one", "train question 2", "fresh two")]
    (tmp_path / "train.json").write_text(json.dumps(train))
    (tmp_path / "fit.json").write_text(json.dumps(fit_records))
    config = _config(fit_source=str(tmp_path / "fit.json"), fit_offset=0, fit_limit=3)
    with config.unlocked():
        config.data.train_source = str(tmp_path / "train.json")
        config.data.train_limit = 4
    config_lib.validate(config)  # another file: no range overlap to find
    kept = prepare.fit_conversations(config)
    assert [c[0]["content"] for c in kept] == ["fresh one", "fresh two"]


def test_draft_shape_must_match_the_table_section():
    config = _config(head_dim=5)
    with pytest.raises(UsageError, match=r"draft\.engram_dim=64 .* = 80"):
        config_lib.validate(config)


def test_missing_table_without_a_fit_source_is_a_clear_error(tmp_path):
    config = _config(fit_source="", table_path=str(tmp_path / "none.safetensors"))
    config_lib.validate(config)
    with pytest.raises(UsageError, match=r"none\.safetensors does not exist and cannot be fitted here"):
        prepare.prepare_table(config, "fp", "tok", 49152, load_target=lambda: None)
