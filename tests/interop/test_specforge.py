"""SpecForge 0.2.0 (PyPI), sgl-project's trainer, warm-starts from an export's `specforge/` directory with its
own code and computes the JAX draft's outputs.

`consumer_specforge.py` builds a SpecForge DSpark run on the directory (its typed run config,
`resolve_run`, `build_model_bundle`: the draft config, `warm_start_draft_model`, the target's embedding and
LM head from the export's main directory), holds the directory's tensors strictly to the draft's state
dict, takes the context by `extract_context_feature` and runs `OnlineDSparkModel.forward` on fixed anchors.
The smoke baseline export and Draft Memory's baseline part give the JAX draft's base and Markov logits,
confidence logits and predecessors; a shifted Markov predecessor, a wrong MASK row, aux layers off by one,
a config without `dflash_config` (which SpecForge runs without complaint, its heads dropped) and the main
directory (DeepSpec's config, which SpecForge refuses) do not, and the checker
(`dspark_jax/interop/consumers/specforge.py`) says which of them it catches.
"""

import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dspark_jax.interop import consumers
from tests.interop import exports

NAME = "specforge"


def _copy(export, tmp, edit):
    """A copy of the export's SpecForge directory at `tmp / 'specforge'`, `edit` applied to its config, with
    the main directory's files linked beside it (the target's embedding and LM head, as in the export)."""
    tmp.mkdir(parents=True)
    directory = shutil.copytree(consumers.directory_of(export.directory, NAME), tmp / NAME)
    for name in ("config.json", "model.safetensors"):
        (tmp / name).symlink_to(export.directory / name)
    exports.edit_config(directory, edit)
    return directory


def _nested(key, change):
    """A config edit: `change` applied to `key` in `dflash_config` (what SpecForge reads) and at the top
    level."""

    def edit(config):
        config["dflash_config"][key] = change(config["dflash_config"][key])
        config[key] = change(config[key])

    return edit


@pytest.fixture(scope="module")
def runs(baseline, request, tmp_path_factory):
    """Each case's directory and SpecForge's run on it: `(directory, outputs or None, failure or None)`
    (a failed run's outputs where it wrote them). The runs are fresh interpreters started side by side, the
    baseline's while Draft Memory's export is made."""
    tmp = tmp_path_factory.mktemp("specforge")

    def run(case, directory, export):
        out = tmp / "runs" / case
        try:
            return directory, exports.run_consumer(NAME, directory, export.inputs, out), None
        except AssertionError as failure:
            written = out / "outputs.npz"
            return directory, dict(np.load(written)) if written.exists() else None, str(failure)

    shift = _nested("target_layer_ids", lambda ids: [i + 1 for i in ids])
    cases = {
        "baseline": consumers.directory_of(baseline.directory, NAME),
        "mask": _copy(baseline, tmp / "mask", _nested("mask_token_id", lambda m: m + 1)),
        "layers": _copy(baseline, tmp / "layers", shift),
        "no_dflash_config": _copy(baseline, tmp / "no_dflash_config", lambda c: c.pop("dflash_config")),
        "main": baseline.directory,
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = {case: pool.submit(run, case, directory, baseline) for case, directory in cases.items()}
        memory = request.getfixturevalue("memory")
        done["memory"] = pool.submit(run, "memory", consumers.directory_of(memory.directory, NAME), memory)
        return {case: future.result() for case, future in done.items()}


def _matches(case, runs, export):
    """The case's run loaded the directory strictly and computed the JAX draft's outputs."""
    directory, got, failure = runs[case]
    assert failure is None, failure
    assert not (got["unexpected"].size or got["missing"].size or got["different"].size)
    exports.assert_matches(got, export.want)
    assert consumers.check_directory(directory, [NAME]) == []


def test_the_baseline_export_runs_in_specforge_as_the_jax_draft(baseline, runs):
    """SpecForge's run loads every tensor of the baseline's directory and no other (the target's embedding
    and LM head from the main directory); its base and Markov logits and confidence logits equal the JAX
    draft's to RTOL with the same predecessors, and the checker finds nothing."""
    _matches("baseline", runs, baseline)


def test_draft_memorys_baseline_part_runs_in_specforge_as_the_jax_draft(memory, runs):
    """Draft Memory's `--baseline_part` export: SpecForge runs its baseline DSpark draft (no memory adapter
    tensor in the directory) as the JAX baseline part computes it, and the checker finds nothing."""
    _matches("memory", runs, memory)


def test_specforge_parses_the_config_as_exported(baseline, runs):
    """SpecForge's parse of the directory's config (it reads no side files): its capture layers and the
    draft's target_layer_ids are the run's aux layers, MASK the draft's row, the block size, Markov rank
    and confidence head input (hidden + rank) those of the draft."""
    got = runs["baseline"][1]
    draft, aux = baseline.config.draft, list(baseline.config.data.aux_layer_ids)
    assert got["capture_layers"].tolist() == got["target_layer_ids"].tolist() == aux
    assert int(got["mask_token_id"]) == draft.mask_token_id == exports.MASK_ROW
    assert int(got["block_size"]) == draft.block_size
    assert int(got["markov_rank"]) == draft.markov_rank
    assert int(got["confidence_inputs"]) == baseline.inputs["hidden"].shape[-1] + draft.markov_rank


def test_a_markov_predecessor_shifted_by_one_is_told_apart(baseline, runs):
    """The JAX draft's Markov logits with each predecessor one slot late differ from SpecForge's far beyond
    RTOL: the comparison would catch a predecessor off by one."""
    shifted = dict(baseline.want, markov=baseline.want["markov_shifted"])
    assert exports.differences(runs["baseline"][1], shifted)["markov"] > 100 * exports.RTOL


def test_the_wrong_mask_row_changes_specforges_forward(baseline, runs):
    """A copy whose config names MASK + 1 (in `dflash_config`, which SpecForge reads, and at the top level):
    SpecForge embeds that row in every block, so its logits no longer match. The checker does not catch it:
    any row of the vocabulary is a valid MASK to a loader, only the training run knows which one it used."""
    directory, got, failure = runs["mask"]
    assert failure is None, failure
    assert int(got["mask_token_id"]) == exports.MASK_ROW + 1
    exports.assert_differs(got, baseline.want)
    assert consumers.check_directory(directory, [NAME]) == []


def test_aux_layers_off_by_one_change_specforges_forward_and_are_flagged(baseline, runs):
    """A copy whose target_layer_ids are shifted by one: SpecForge captures and reads layers k + 2, its
    logits no longer match, and the checker flags the ids, the last now the target's last layer."""
    directory, got, failure = runs["layers"]
    assert failure is None, failure
    assert got["capture_layers"].tolist() == [i + 1 for i in baseline.config.data.aux_layer_ids]
    exports.assert_differs(got, baseline.want)
    problems = consumers.check_directory(directory, [NAME])
    assert len(problems) == 1 and "taps the target's last layer" in problems[0], problems


def test_without_dflash_config_specforge_drops_the_heads_silently(baseline, runs):
    """A copy whose config lacks `dflash_config` (the DSpark keys only at the top level, which SpecForge
    ignores): SpecForge builds and warm-starts it without a word, dropping the Markov and confidence tensors
    it has no place for, and runs another draft: no Markov term (its logits are the base logits), no
    confidence head, layers [1, 2, 2] (its default for 3 draft layers on a 5-layer target). The strict
    script fails naming the dropped tensors, and the checker flags the config."""
    directory, got, failure = runs["no_dflash_config"]
    heads = ["confidence_head.proj.bias", "confidence_head.proj.weight"]
    heads += ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
    assert failure and "does not match SpecForge's DSparkDraftModel" in failure
    assert all(name in failure for name in heads)
    assert got["unexpected"].tolist() == heads and not got["missing"].size
    assert int(got["markov_rank"]) == 0 and int(got["confidence_inputs"]) == 0
    assert np.array_equal(got["markov"], got["base"]) and np.isnan(got["confidence"]).all()
    assert got["capture_layers"].tolist() == [1, 2, 2] != list(baseline.config.data.aux_layer_ids)
    diff = exports.differences(got, baseline.want)
    assert diff["base"] > 100 * exports.RTOL and diff["markov"] > 100 * exports.RTOL, diff
    problems = consumers.check_directory(directory, [NAME])
    assert len(problems) == 1 and "no dflash_config" in problems[0], problems


def test_specforge_refuses_the_main_directory(baseline, runs, tmp_path):
    """The main directory (DeepSpec's config, `architectures: ["Qwen3DSparkModel"]`, the DSpark keys at the
    top level): SpecForge's draft config loader refuses the architecture, and the checker flags it (and the
    missing `dflash_config`) when it reads that directory as SpecForge's."""
    _, got, failure = runs["main"]
    assert got is None and "draft architecture 'Qwen3DSparkModel' is not registered" in failure
    for name in ("config.json", "model.safetensors"):  # the main directory's files without its subdirectories
        (tmp_path / name).symlink_to(baseline.directory / name)
    problems = consumers.check_directory(tmp_path, [NAME])
    assert any("architectures=['Qwen3DSparkModel']" in p for p in problems), problems
    assert any("no dflash_config" in p for p in problems), problems
