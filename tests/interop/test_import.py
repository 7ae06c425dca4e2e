"""A draft in any consumer's own form imports as step 0 of a run, bit for bit: DeepSpec's layout, SpecForge's
directory, speculators' directory, and the trainers' directories as they write them themselves (SpecForge's
`export --to hf` keeps the DSpark keys in `dflash_config` only; speculators' `save_pretrained` leaves out
the target's embedding and LM head and records no target depth). What cannot be this project's draft is
refused by name before anything is written: DFlash's 1 + N block layout, a draft vocabulary."""

import json
import shutil

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from dspark_jax.interop import deepspec_layout as layout
from dspark_jax.interop.consumers import specforge
from dspark_jax.run import checkpoints, draft_state
from dspark_jax.run.deepspec_checkpoint import import_draft, target_shape
from tests.interop import exports
from tests.marks import tiered


def _params(config, workdir):
    """The imported checkpoint's parameters by path, as arrays."""
    target = target_shape(config)
    mesh = exports.sharding.make_mesh(config.mesh.to_dict())
    _, params, _, _ = draft_state.restore_draft(config, target, mesh, workdir)
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(params)}


def _as_trainers_write(directory, name):
    """`directory` (the export's own form for trainer `name`) as the trainer itself writes a draft."""
    config = json.loads((directory / layout.CONFIG_FILE).read_text())
    tensors = load_file(directory / layout.WEIGHTS_FILE)
    if name == "specforge":  # `specforge export --to hf`: the DSpark keys nested only, bf16 dtype recorded
        config = {k: v for k, v in config.items() if k not in specforge.KEYS or k == "target_layer_ids"}
        config.pop("target_layer_ids")
        config["dtype"] = "bfloat16"
    else:  # speculators' save_pretrained: no embed_tokens / lm_head (full vocabulary), no target depth
        for key in layout.TARGET_TENSORS:
            tensors.pop(key)
        config.pop("num_target_layers")
        config["auto_map"] = {"": "config.DSparkSpeculatorConfig"}
    (directory / layout.CONFIG_FILE).write_text(json.dumps(config))
    save_file(tensors, str(directory / layout.WEIGHTS_FILE), metadata={"format": "pt"})


FORMS = ["deepspec", "specforge", "speculators", "specforge-own", "speculators-own"]


@pytest.mark.parametrize("form", tiered(FORMS, fast=["deepspec", "speculators-own"], slow=FORMS))
def test_every_form_imports_bit_for_bit(baseline, form, tmp_path):
    name = form.split("-")[0]
    source = baseline.directory if name == "deepspec" else baseline.directory / name
    if form.endswith("-own"):
        source = shutil.copytree(source, tmp_path / "own")
        _as_trainers_write(source, name)
    import_draft(baseline.config, source, tmp_path / "run")
    got = _params(baseline.config, tmp_path / "run")
    want = _params(baseline.config, baseline.directory.parent / "run")
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[p], want[p]) for p in want), [
        p for p in want if not np.array_equal(got[p], want[p])
    ]
    with checkpoints.Checkpointer(tmp_path / "run" / "checkpoints") as checkpointer:
        assert checkpointer.meta(0)["imported_form"] == name


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: c.update(sample_from_anchor=False),
            r"sample_from_anchor is not true: .*DFlash's 1 \+ N layout",
        ),
        (
            lambda c: c.update(draft_vocab_size=256),
            r"a draft vocabulary of 256 tokens \(speculators's form\)",
        ),
    ],
)
def test_what_is_not_this_projects_draft_is_refused_before_writing(baseline, edit, message, tmp_path):
    source = shutil.copytree(baseline.directory / "speculators", tmp_path / "broken")
    exports.edit_config(source, edit)
    with pytest.raises(ValueError, match=message):
        import_draft(baseline.config, source, tmp_path / "run")
    assert not (tmp_path / "run").exists()
