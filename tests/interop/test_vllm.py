"""vLLM 0.34.0 (the PyPI wheel, on CPU) resolves an export's main directory as a DSpark draft and runs it.

`consumer_vllm.py` takes the directory through vLLM's own config path (`SpeculativeConfig(method="dspark")`,
`VllmConfig`, the registry's class for its architectures), builds `Qwen3DSparkForCausalLM`, fills it with its
own `load_weights` (held strictly to the file), takes the target's states by vLLM's capture ids
(`get_eagle3_aux_layers_from_config`: `target_layer_ids` + 1, the state entering that layer) and runs vLLM's
own draft forward and Markov chain, only the paged attention and two vllm._C kernels replaced. The smoke
baseline and Draft Memory's baseline part give the JAX draft's base and Markov logits, confidence logits and
predecessors; a draft vocabulary's export gives them over its K proposals with `d2t` mapping proposal i to
the run's vocabulary. Broken copies do not: a Markov predecessor one slot off, the wrong MASK row, aux layers
one off either way, a draft vocabulary without `d2t` (vLLM takes the identity map without a word) and
`DSparkDraftModel` with a model_type other than qwen3 (vLLM takes it for DeepSeek-V4's draft); the checker
(`dspark_jax/interop/consumers/vllm.py`) says which of them it catches.

The default run holds the baseline export's checks (one export, one vLLM run: about 40 s on 2 cores); Draft
Memory's baseline part, the draft vocabulary and the broken cases are `slow` (two more exports, the draft
vocabulary's with its caches, and eight more vLLM runs, two at a time: about 2 to 3 minutes more).
"""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax import sharding
from dspark_jax.interop import consumers
from dspark_jax.run.deepspec_checkpoint import draft_vocabulary
from tests.interop import exports

NAME = "vllm"


@pytest.fixture(scope="module")
def baseline_run(baseline, tmp_path_factory):
    return exports.run_consumer(NAME, baseline.directory, baseline.inputs, tmp_path_factory.mktemp("run"))


def _copy(export, tmp, edit=None):
    return exports.copy_for(export, NAME, tmp, edit)


def _without_d2t(export, tmp):
    directory = _copy(export, tmp)
    tensors = load_file(directory / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, directory / "model.safetensors")
    return directory


def _run(directory, export, out):
    """vLLM's run: (outputs, or those it wrote before failing, or None; its failure or None)."""
    try:
        return exports.run_consumer(NAME, directory, export.inputs, out), None
    except AssertionError as failure:
        written = out / "outputs.npz"
        return (dict(np.load(written)) if written.exists() else None), str(failure)


@pytest.fixture(scope="module")
def more_runs(baseline, memory, vocab, tmp_path_factory):
    """`{case: (directory, outputs or None, failure or None)}`: Draft Memory's baseline part, the draft
    vocabulary and the broken copies, run side by side (fresh interpreters)."""
    tmp = tmp_path_factory.mktemp(f"{NAME}_more")
    cases = {
        "memory": (memory.directory, memory),
        "vocab": (vocab.directory, vocab),
        "vocab_without_d2t": (_without_d2t(vocab, tmp / "nod2t"), vocab),
        "mask": (
            _copy(baseline, tmp / "mask", lambda c: c.update(mask_token_id=c["mask_token_id"] + 1)),
            baseline,
        ),
        "layers_down": (_copy(baseline, tmp / "layers_down", exports.shift_layers(-1)), baseline),
        "layers_up": (_copy(baseline, tmp / "layers_up", exports.shift_layers(+1)), baseline),
        "dspark_draft_model_qwen3": (
            _copy(baseline, tmp / "ds_qwen3", lambda c: c.update(architectures=["DSparkDraftModel"])),
            baseline,
        ),
        "dspark_draft_model_qwen2": (
            _copy(
                baseline,
                tmp / "ds_qwen2",
                lambda c: c.update(architectures=["DSparkDraftModel"], model_type="qwen2"),
            ),
            baseline,
        ),
    }

    def run(case):
        directory, export = cases[case]
        return (directory, *_run(directory, export, tmp / "runs" / case))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cases, pool.map(run, cases)))


def _parsed(got) -> dict:
    return json.loads(str(got["parsed"]))


def test_the_baseline_export_runs_in_vllm_as_the_jax_draft(baseline, baseline_run):
    """vLLM's `load_weights` fills every parameter of its Qwen3DSparkForCausalLM from the baseline's main
    directory, each with the file's value, and leaves no tensor of the file unused; the states it captures are
    `data.aux_layer_ids` + 1 (each the state entering that layer: DeepSpec's layer outputs), and its base and
    Markov logits and confidence logits equal the JAX draft's to RTOL with the same predecessors; the checker
    finds nothing."""
    exports.assert_matches(baseline_run, baseline.want)
    assert list(baseline_run["layer_ids"]) == [i + 1 for i in baseline.config.data.aux_layer_ids]
    assert consumers.check_directory(baseline.directory, [NAME]) == []


def test_vllms_config_path_resolves_the_export_as_dspark(baseline, baseline_run):
    """vLLM's own config path on the main directory: `SpeculativeConfig(method="dspark")` checks the method
    against the class the draft declares (Qwen3DSparkForCausalLM, DSparkSpeculatorConfig), takes
    `num_speculative_tokens` (and the lookahead: the anchor is the first prediction) from `block_size`,
    `get_eagle3_aux_layers_from_config` gives `target_layer_ids` + 1, and the built model reads the MASK row,
    the Markov rank, the confidence head on [h; markov_w1[prev]], fc over the A layers and the whole
    vocabulary as the draft's (no d2t)."""
    parsed = _parsed(baseline_run)
    main = json.loads((baseline.directory / "config.json").read_text())
    s, h, r = main["block_size"], main["hidden_size"], main["markov_rank"]
    assert s == baseline.config.draft.block_size
    assert parsed["method"] == "dspark" and parsed["speculator_config"] == "DSparkSpeculatorConfig"
    assert parsed["model_class"] == "Qwen3DSparkForCausalLM" and parsed["architectures"] == [
        "Qwen3DSparkModel"
    ]
    assert parsed["num_speculative_tokens"] == parsed["num_lookahead_tokens"] == parsed["block_size"] == s
    assert parsed["aux_layer_ids"] == [i + 1 for i in main["target_layer_ids"]]
    assert parsed["uses_aux_hidden_states"] and parsed["fc_input_size"] == h * len(main["target_layer_ids"])
    assert parsed["mask_token_id"] == exports.MASK_ROW and parsed["markov_rank"] == r
    assert parsed["confidence_head"] == {"with_markov": True, "inputs": h + r}
    assert parsed["draft_vocab_size"] == parsed["vocab_size"] == main["vocab_size"]
    assert parsed["sample_from_anchor"] is True
    assert "d2t" not in baseline_run


def test_a_markov_predecessor_one_slot_off_is_told_apart(baseline, baseline_run):
    """The comparison sees a Markov term read from the token one slot back: vLLM's Markov logits match the
    JAX draft's and not those of predecessors shifted by one."""
    assert exports.matches(baseline_run, baseline.want)
    shifted = baseline.want | {"markov": baseline.want["markov_shifted"]}
    assert exports.differences(baseline_run, shifted)["markov"] > 100 * exports.RTOL


@pytest.mark.slow
def test_draft_memorys_baseline_part_runs_in_vllm_as_the_jax_draft(memory, more_runs):
    """Draft Memory's `--baseline_part` export: vLLM loads it strictly and runs its baseline DSpark draft as
    the JAX baseline part computes it; the checker finds nothing."""
    directory, got, failure = more_runs["memory"]
    assert failure is None, failure
    assert exports.matches(got, memory.want), exports.differences(got, memory.want)
    assert consumers.check_directory(directory, [NAME]) == []


@pytest.mark.slow
def test_a_draft_vocabulary_maps_through_d2t_to_the_runs_vocabulary(vocab, more_runs):
    """A draft vocabulary's export: the file's `d2t` lands in vLLM's `draft_id_to_target_id`, and vLLM's
    `map_draft_to_target(i)` = i + d2t[i] gives the run's own vocabulary (its training cache's DRAFT_VOCAB
    most used tokens, sorted); the base and Markov logits over the K proposals and the confidence logits are
    the JAX draft's; the checker finds nothing."""
    directory, got, failure = more_runs["vocab"]
    assert failure is None, failure
    k = exports.DRAFT_VOCAB
    assert got["base"].shape[-1] == got["markov"].shape[-1] == vocab.want["markov"].shape[-1] == k
    assert exports.matches(got, vocab.want), exports.differences(got, vocab.want)
    np.testing.assert_array_equal(got["d2t"], load_file(directory / "model.safetensors")["d2t"])
    ids_k = draft_vocabulary(vocab.config, sharding.make_mesh(vocab.config.mesh.to_dict()))
    np.testing.assert_array_equal(got["proposal_ids"], ids_k)
    parsed = _parsed(got)
    assert parsed["draft_vocab_size"] == k and parsed["vocab_size"] > k
    assert consumers.check_directory(directory, [NAME]) == []


@pytest.mark.slow
def test_a_draft_vocabulary_without_d2t_proposes_the_wrong_tokens(vocab, more_runs):
    """Without `d2t`, vLLM's loader drops its `draft_id_to_target_id` without a word and keeps the zeros it
    built: proposal i is target token i. The logits over the K proposals are unchanged (the strict load names
    the unfilled parameter), but the mapping is not the run's vocabulary wherever that vocabulary leaves
    0 .. K - 1 (the smoke vocabulary does for its last few ids only: those with d2t != 0), and there the
    drafted tokens differ: vLLM's greedy proposals, mapped by vLLM, are not the JAX draft's mapped to the
    run's vocabulary exactly where its argmax is such a proposal. The checker flags the missing tensor."""
    directory, got, failure = more_runs["vocab_without_d2t"]
    assert failure is not None and "does not fill ['draft_id_to_target_id']" in failure, failure
    assert exports.matches(got, vocab.want)
    k = exports.DRAFT_VOCAB
    np.testing.assert_array_equal(got["proposal_ids"], np.arange(k))
    ids_k = draft_vocabulary(vocab.config, sharding.make_mesh(vocab.config.mesh.to_dict()))
    moved = got["proposal_ids"] != ids_k
    np.testing.assert_array_equal(moved, load_file(vocab.directory / "model.safetensors")["d2t"] != 0)
    assert moved.any()
    argmax = vocab.want["markov"].argmax(-1)
    drafted_wrong = got["proposal_ids"][got["markov"].argmax(-1)] != ids_k[argmax]
    np.testing.assert_array_equal(drafted_wrong, moved[argmax])
    assert drafted_wrong.any()
    problems = consumers.check_directory(directory, [NAME])
    assert len(problems) == 1 and "missing tensor d2t" in problems[0], problems


@pytest.mark.slow
def test_the_wrong_mask_row_changes_the_forward_and_the_checker_cannot_see_it(baseline, more_runs):
    """A copy naming mask_token_id + 1 loads and runs (vLLM reads the new row), but its blocks embed another
    row: the base logits no longer match. The checker passes it: any row of the vocabulary is a valid MASK."""
    directory, got, failure = more_runs["mask"]
    assert failure is None, failure
    assert _parsed(got)["mask_token_id"] == exports.MASK_ROW + 1
    assert exports.differences(got, baseline.want)["base"] > 100 * exports.RTOL
    assert consumers.check_directory(directory, [NAME]) == []


@pytest.mark.slow
def test_aux_layers_one_layer_down_change_the_forward_unseen(baseline, more_runs):
    """A copy whose target_layer_ids are one layer lower feeds fc other (inner) layers' states: vLLM captures
    ids one lower, and the forward no longer matches. The checker cannot see it: the ids are valid."""
    directory, got, failure = more_runs["layers_down"]
    assert failure is None, failure
    assert list(got["layer_ids"]) == list(baseline.config.data.aux_layer_ids)
    assert exports.differences(got, baseline.want)["base"] > 100 * exports.RTOL
    assert consumers.check_directory(directory, [NAME]) == []


@pytest.mark.slow
def test_aux_layers_one_layer_up_end_at_the_last_layer_which_vllm_alone_captures(baseline, more_runs):
    """A copy whose target_layer_ids are one layer higher ends at the target's last layer: vLLM's config path
    takes it (ids + 1, the last one the layer count, captured after the last layer, raw, before the final
    norm: the state this project's caches hold, so vLLM would serve such a draft), while transformers'
    hidden states hold the final norm's output there, so this run cannot be fed and stops. The checker passes
    it for vLLM (`data.tap_last_layer` drafts), and flags it for the consumers that cannot read it."""
    directory, got, failure = more_runs["layers_up"]
    num_layers = baseline.inputs["hidden"].shape[1] - 1
    ids = [i + 2 for i in baseline.config.data.aux_layer_ids]
    assert ids[-1] == num_layers
    assert got is None and f"vLLM capture ids {ids} on a {num_layers}-layer target" in failure, failure
    assert consumers.check_directory(directory, [NAME]) == []
    problems = consumers.check_directory(directory, ["sglang", "deepspec"])
    assert len(problems) == 2 and all("taps the target's last layer" in p for p in problems), problems


@pytest.mark.slow
def test_dspark_draft_model_is_qwen3s_only_with_model_type_qwen3(baseline, more_runs):
    """`architectures: ["DSparkDraftModel"]` is DeepSeek-V4's draft name, which vLLM rewrites to
    Qwen3DSparkModel only with model_type qwen3: that copy runs as the JAX draft and the checker passes it.
    With model_type qwen2 vLLM takes it for DeepSeek-V4's draft (model_type rewritten to deepseek_v4,
    DSparkDeepseekV4ForCausalLM) and the run stops there; the checker flags the architectures."""
    _, got, failure = more_runs["dspark_draft_model_qwen3"]
    assert failure is None, failure
    assert _parsed(got)["architectures"] == ["Qwen3DSparkModel"] and exports.matches(got, baseline.want)
    assert consumers.check_directory(more_runs["dspark_draft_model_qwen3"][0], [NAME]) == []

    directory, got, failure = more_runs["dspark_draft_model_qwen2"]
    assert got is None and "vLLM resolves the draft to DSparkDeepseekV4ForCausalLM" in failure, failure
    assert "'model_type': 'deepseek_v4'" in failure
    problems = consumers.check_directory(directory, [NAME])
    assert any("architectures=['DSparkDraftModel']" in p and "[vllm-method]" in p for p in problems), problems
