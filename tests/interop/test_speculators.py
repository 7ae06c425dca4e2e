"""speculators (vllm-project, 0.9.0 from PyPI) loads an export's `speculators/` directory and runs it.

`consumer_speculators.py` runs speculators' own code in a fresh interpreter: `SpeculatorModel.from_pretrained`
(held strictly to the file), its layer convention (`aux_hidden_state_layer_ids` i reads the state entering
layer i, `hidden[i]`) and its training forward `DSparkDraftModel.forward` on fixed anchors, with its eager
attention and eager loss on this CPU. The smoke baseline, Draft Memory's baseline part and a draft
vocabulary's export give the JAX draft's base and Markov logits, confidence logits and predecessors, and
pass the checker (`dspark_jax/interop/consumers/speculators.py`). Broken copies fail: a Markov predecessor
one slot off, the wrong MASK row, aux ids one layer off either way (speculators' +1 left out, or added
twice), DFlash's 1 + N layout (`sample_from_anchor: false`) and the main directory, which speculators'
loader sends to an auto-conversion that knows DFlash only.

Slow: three exports and eight fresh interpreters, each importing speculators (torch's compiler stack, about
8 s of CPU); the module took 3.5 min on this 2-core host under load.
"""

import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax.interop import consumers
from tests.interop import exports

NAME = "speculators"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def baseline_run(baseline, tmp_path_factory):
    return exports.run_consumer(NAME, _own(baseline), baseline.inputs, tmp_path_factory.mktemp("run"))


def _own(export):
    return consumers.directory_of(export.directory, NAME)


def _broken(export, tmp, edit):
    """A copy of the export's speculators directory with `edit` applied to its config.json."""
    copy = tmp / "broken"
    shutil.copytree(_own(export), copy)
    exports.edit_config(copy, edit)
    return copy


@pytest.mark.parametrize("name", ["baseline", "memory"])
def test_speculators_loads_the_export_strictly_and_runs_the_jax_drafts_logits(name, request, tmp_path):
    """The smoke baseline's and Draft Memory's baseline part's `speculators/` directories load with
    speculators' own loader, each tensor from the file and none left over, read the target's layers
    `data.aux_layer_ids` + 1 (the states entering those layers: DeepSpec's layer outputs), and its forward
    gives the JAX draft's base and Markov logits and confidence logits within RTOL on the same predecessors;
    the checker has no problem with either."""
    export = request.getfixturevalue(name)
    if name == "baseline":
        got = request.getfixturevalue("baseline_run")
    else:
        got = exports.run_consumer(NAME, _own(export), export.inputs, tmp_path)
    exports.assert_matches(got, export.want)
    assert list(got["layer_ids"]) == [i + 1 for i in export.config.data.aux_layer_ids]
    assert consumers.check_directory(export.directory, [NAME]) == []


def test_speculators_parses_the_config_as_its_dspark_config(baseline, baseline_run):
    """speculators' own config parser (`SpeculatorModelConfig`, through its loader) reads the exported
    config.json as a `DSparkSpeculatorConfig` with the draft's block, MASK row, Markov rank, vLLM-convention
    layer ids, the anchor layout, the whole vocabulary as the draft's, and the draft's layer shape as the
    Qwen3 config it builds the layers from (draft layers, not the target's)."""
    parsed = json.loads(str(baseline_run["parsed"]))
    main = json.loads((baseline.directory / "config.json").read_text())
    assert parsed["class"] == "DSparkSpeculatorConfig"
    assert {k: parsed[k] for k in ("block_size", "mask_token_id", "markov_rank", "markov_head_type")} == {
        k: main[k] for k in ("block_size", "mask_token_id", "markov_rank", "markov_head_type")
    }
    assert parsed["aux_hidden_state_layer_ids"] == [i + 1 for i in main["target_layer_ids"]]
    assert parsed["sample_from_anchor"] is True and parsed["draft_vocab_size"] == main["vocab_size"]
    assert parsed["enable_confidence_head"] is True and parsed["confidence_head_with_markov"] is True
    layer = parsed["transformer_layer_config"]
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "model_type")  # fmt: skip
    assert {k: layer[k] for k in shape} == {k: main[k] for k in shape}
    assert layer["num_hidden_layers"] == baseline.config.draft.num_layers
    assert layer["rope_parameters"]["rope_theta"] == main["rope_parameters"]["rope_theta"]


def test_speculators_runs_a_draft_vocabulary_through_its_t2d_and_d2t(vocab, tmp_path):
    """A draft vocabulary's export loads with its `t2d` / `d2t`, which speculators' `load_vocab_mappings`
    accepts (its checks: t2d has K ones, d2t K entries) and keeps: t2d marks the K target ids that
    `i + d2t[i]` lists, those of the main directory's d2t; its forward gives the JAX draft's K-column
    logits."""
    got = exports.run_consumer(NAME, _own(vocab), vocab.inputs, tmp_path)
    k = exports.DRAFT_VOCAB
    assert got["markov"].shape[-1] == got["base"].shape[-1] == vocab.want["markov"].shape[-1] == k
    exports.assert_matches(got, vocab.want)
    t2d, d2t = got["t2d"], got["d2t"]
    assert t2d.dtype == bool and t2d.sum() == k and d2t.shape == (k,)
    np.testing.assert_array_equal(np.flatnonzero(t2d), np.arange(k) + d2t)
    np.testing.assert_array_equal(d2t, load_file(vocab.directory / "model.safetensors")["d2t"])
    assert consumers.check_directory(vocab.directory, [NAME]) == []


def test_a_markov_predecessor_one_slot_off_is_told_apart(baseline, baseline_run):
    """The comparison sees a Markov term read from the token one slot back: speculators' Markov logits
    match the JAX draft's and not those of predecessors shifted by one."""
    assert exports.matches(baseline_run, baseline.want)
    shifted = baseline.want | {"markov": baseline.want["markov_shifted"]}
    assert exports.differences(baseline_run, shifted)["markov"] > 100 * exports.RTOL


def test_the_wrong_mask_row_changes_the_forward_and_the_checker_cannot_see_it(baseline, tmp_path):
    """A copy naming mask_token_id + 1 loads and runs, but its blocks embed another row: the base logits no
    longer match. The checker passes it: any row of the vocabulary is a valid MASK to it."""
    copy = _broken(baseline, tmp_path, lambda c: c.update(mask_token_id=c["mask_token_id"] + 1))
    got = exports.run_consumer(NAME, copy, baseline.inputs, tmp_path / "run")
    assert exports.differences(got, baseline.want)["base"] > 100 * exports.RTOL
    assert consumers.check_directory(copy, [NAME]) == []


@pytest.mark.parametrize(
    "shift, flagged",
    [
        (-1, None),  # DeepSpec's ids, speculators' +1 left out: inner layers, nothing to see
        (+1, "taps the target's last layer"),  # +1 twice: [3, 4, 5] - 1 ends at the target's last layer
    ],
)
def test_aux_layer_ids_one_off_change_the_forward(baseline, tmp_path, shift, flagged):
    """A copy whose aux_hidden_state_layer_ids are one layer off feeds `fc` other states: the forward no
    longer matches. The checker flags the ids ending at the target's last layer (+1 added twice) and cannot
    see DeepSpec's own ids (+1 left out), which are inner layers too."""
    key = "aux_hidden_state_layer_ids"
    copy = _broken(baseline, tmp_path, lambda c: c.update({key: [i + shift for i in c[key]]}))
    got = exports.run_consumer(NAME, copy, baseline.inputs, tmp_path / "run")
    assert list(got["layer_ids"]) == [i + 1 + shift for i in baseline.config.data.aux_layer_ids]
    assert exports.differences(got, baseline.want)["base"] > 100 * exports.RTOL
    problems = consumers.check_directory(copy, [NAME])
    if flagged:
        assert len(problems) == 1 and flagged in problems[0] and key in problems[0], problems
    else:
        assert problems == []


def test_dflash_layout_reads_the_markov_predecessor_one_slot_off(baseline, tmp_path):
    """`sample_from_anchor: false` (DFlash's 1 + N layout) keeps the blocks, so the base logits still match,
    but conditions slot k's Markov term on the token of slot k - 1: the predecessors differ and the Markov
    logits are the JAX draft's with shifted predecessors. The checker flags it."""
    copy = _broken(baseline, tmp_path, lambda c: c.update(sample_from_anchor=False))
    got = exports.run_consumer(NAME, copy, baseline.inputs, tmp_path / "run")
    d = exports.differences(got, baseline.want)
    assert d["base"] <= exports.RTOL and d["predecessors"] > 0 and d["markov"] > 100 * exports.RTOL, d
    np.testing.assert_array_equal(got["predecessors"][..., 1:], baseline.want["predecessors"][..., :-1])
    shifted = baseline.want | {"markov": baseline.want["markov_shifted"]}
    assert exports.differences(got, shifted)["markov"] <= exports.RTOL
    problems = consumers.check_directory(copy, [NAME])
    assert len(problems) == 1 and "sample_from_anchor=False" in problems[0], problems


def test_speculators_refuses_the_main_directory(baseline, tmp_path):
    """The main directory (DeepSpec's config, no `speculators_model_type`) goes to speculators'
    auto-conversion, which refuses it (it converts DFlash only); the checker, reading the main directory as
    speculators', flags the missing model type."""
    refusal = (
        f"NotImplementedError: Cannot auto-convert checkpoint '{baseline.directory}': unrecognized external "
        "format. Supported auto-conversion: DFlash."
    )
    with pytest.raises(AssertionError, match=re.escape(refusal)):
        exports.run_consumer(NAME, baseline.directory, baseline.inputs, tmp_path / "run")
    main = tmp_path / "main"
    main.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(baseline.directory / f, main / f)
    problems = consumers.check_directory(main, [NAME])
    assert len(problems) == 1 and "speculators_model_type=None" in problems[0], problems
