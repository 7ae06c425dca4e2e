"""A serving consumer is one record: a toy engine registered here (DeepSpec's layout plus a file of its own,
and no reading of the target's last layer) is exported for, checked, refused and named by the project's own
code, with no other edit."""

import json
import shutil

import pytest

from dspark_jax.interop import consumers
from dspark_jax.interop.consumers import base, deepspec
from dspark_jax.run.deepspec_checkpoint import export_draft
from tests.interop import exports

TOY_FILE = "toy_engine.json"
LAST_LAYER = "the toy engine captures at the input of layer k + 1 [toy]"


def _side_files(sources: base.SideSources) -> dict:
    c = sources.config_json
    return {
        TOY_FILE: {
            "draft": str(sources.directory),
            "block_size": c["block_size"],
            "target_layer_ids": list(c["target_layer_ids"]),
        }
    }


def _check(c, specs, out: base.Problems, directory) -> None:
    """DeepSpec's rules, and the toy's file agreeing with config.json."""
    deepspec.CONSUMER.check(c, specs, out, directory)
    if not (directory / TOY_FILE).is_file():
        out.add(TOY_FILE, "missing [toy]")
        return
    doc = json.loads((directory / TOY_FILE).read_text())
    for key in ("block_size", "target_layer_ids"):
        if doc.get(key) != c.get(key):
            out.add(TOY_FILE, f"{key}={doc.get(key)!r}, config.json has {c.get(key)!r} [toy]")


TOY = base.Consumer(
    name="toy",
    release="none (a test's)",
    check=_check,
    refuse=lambda facts: None,
    side_files=_side_files,
    last_layer=LAST_LAYER,
)


@pytest.fixture(scope="module")
def toy():
    """The toy, registered for this module's tests."""
    consumers.register(TOY)
    yield TOY
    del consumers.CONSUMERS[TOY.name]


@pytest.fixture(scope="module")
def toy_export(toy, tmp_path_factory):
    """A smoke draft exported `--for=toy`."""
    return exports.make_export(tmp_path_factory.mktemp("toy_export"), consumers=TOY.name)


def test_a_registered_name_is_refused_again(toy):
    with pytest.raises(ValueError, match="'toy' is already registered"):
        consumers.register(TOY)


def test_the_export_holds_the_toys_file_alone(toy_export):
    directory = toy_export.directory
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", TOY_FILE]
    config = json.loads((directory / "config.json").read_text())
    assert json.loads((directory / TOY_FILE).read_text()) == {
        "draft": str(directory.resolve()),
        "block_size": config["block_size"],
        "target_layer_ids": config["target_layer_ids"],
    }
    assert consumers.check_directory(directory, [TOY.name]) == []


def test_check_reports_the_toys_problems(toy_export, tmp_path):
    directory = shutil.copytree(toy_export.directory, tmp_path / "copy")
    toys = lambda: [line for line in consumers.check_directory(directory) if line.startswith("toy: ")]
    assert toys() == []  # every registered consumer by default, the toy among them
    exports.edit_config(directory, exports.shift_layers(1))  # (2, 3, 4): the smoke target's last is 4
    assert toys() == [
        "toy: config.json: target_layer_ids=[2, 3, 4] taps the target's last layer 4, whose output "
        f"{LAST_LAYER}; retrain on inner layers (data.aux_layer_ids)",
        "toy: toy_engine.json: target_layer_ids=[1, 2, 3], config.json has [2, 3, 4] [toy]",
    ]
    (directory / TOY_FILE).unlink()
    assert toys()[1:] == ["toy: toy_engine.json: missing [toy]"]


def test_a_draft_tapping_the_last_layer_is_refused_before_anything_is_written(toy_export, tmp_path):
    config = toy_export.config.copy_and_resolve_references()
    config.data.aux_layer_ids = (2, 3, 4)
    with pytest.raises(ValueError, match=r"^toy cannot run this draft: .*tap the target's last layer 4"):
        export_draft(config, toy_export.directory.parent / "run", tmp_path / "out", consumers_text="toy")
    assert not (tmp_path / "out").exists()
    assert f"toy: {LAST_LAYER}" in consumers.last_layer_readers()


def test_an_unknown_consumer_is_refused_in_one_line_naming_the_registered_ones(toy_export, tmp_path):
    run = toy_export.directory.parent / "run"
    with pytest.raises(ValueError) as error:
        export_draft(toy_export.config, run, tmp_path / "out", consumers_text="toy,nope")
    message = str(error.value)
    assert message.startswith("unknown consumer nope:") and "\n" not in message
    assert all(repr(name) in message for name in consumers.CONSUMERS)
    assert not (tmp_path / "out").exists()
