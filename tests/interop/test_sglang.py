"""SGLang 0.5.23 (PyPI) serves an export's main directory as a DSpark draft: its own code loads it and runs
the JAX draft's forward.

`consumer_sglang.py` reads the directory as SGLang's server does (`get_config`, `parse_dspark_draft_config`,
`resolve_runtime_config`), builds `Qwen3DSparkModel` from models/dspark.py and loads it with its own
`load_weights`, held strictly to the file (SGLang itself skips the target's tensors and ignores unknown ones),
takes the target's states by SGLang's capture rule (layer k at the input of layer k + 1) and runs the draft
forward with `TorchNativeAttnBackend` on CPU; `--parse` parses the config and the STS / SPS side files with
SGLang's loaders. The smoke baseline export and Draft Memory's baseline part give the JAX draft's base and
Markov logits, confidence logits and predecessors, and their side files parse; a shifted Markov predecessor,
a wrong MASK row, aux layers off by one, a file with a tensor too many and one too few, a draft vocabulary
and aux layers tapping the target's last layer do not, and the checker (`dspark_jax/interop/consumers/
sglang.py`) says which of them it catches.

The default run holds the baseline export's checks (one export, one forward, two parses: about 60 s on 2
cores); Draft Memory's baseline part and the broken cases are `slow` (two more exports, the draft
vocabulary's with its caches, and seven more runs: about 2 minutes more).
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.interop import consumers
from dspark_jax.interop.consumers import side_files
from tests.interop import exports

NAME = "sglang"
SCRIPT = Path(exports.__file__).with_name(f"consumer_{NAME}.py")
EXTRA, DROPPED = "layers.0.self_attn.extra.weight", "layers.2.mlp.down_proj.weight"


def _copy(export, tmp, edit=None):
    return exports.copy_for(export, NAME, tmp, edit)


def _side_files(directory, temperatures):
    """SGLang's STS calibration (`temperatures`) and an SPS table, written by the export's own makers."""
    files = {
        side_files.STS_FILE: side_files.sts_file(
            temperatures,
            dataset="smoke",
            num_samples=64,
            ece_before=[0.2] * len(temperatures),
            ece_after=[0.1] * len(temperatures),
            step=3,
        ),
        side_files.SPS_FILE: side_files.sps_file(
            [8, 1, 16, 8, 2], [40.0, 90.0, 20.0, 42.0, 80.0], 16, device="cpu"
        ),
    }
    side_files.write_side_files(directory, files)
    return directory


def _loose(export, tmp):
    """A copy whose file holds a tensor SGLang has no parameter for and lacks one it has."""
    directory = _copy(export, tmp)
    tensors = load_file(directory / "model.safetensors")
    tensors[EXTRA] = np.zeros((4, 4), np.float32)
    del tensors[DROPPED]
    save_file(tensors, directory / "model.safetensors")
    return directory


def _parse(directory, out):
    """`consumer_sglang.py --parse` on `directory`: SGLang's parse of its config and side files."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))} | {
        "PYTHONPATH": str(exports.ROOT)
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--parse", str(directory), str(out / "parsed.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=out,
    )
    if proc.returncode:
        raise AssertionError(f"{SCRIPT.name} --parse failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((out / "parsed.json").read_text())


def _run_all(cases, tmp):
    """SGLang's run on each case's directory: `{case: (directory, outputs or None, failure or None)}`; a case
    without an export runs `--parse` (outputs: its JSON). The runs are fresh interpreters, side by side."""

    def run(case):
        directory, export = cases[case]
        out = tmp / "runs" / case
        try:
            if export is None:
                return directory, _parse(directory, out), None
            return directory, exports.run_consumer(NAME, directory, export.inputs, out), None
        except AssertionError as failure:
            return directory, None, str(failure)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(cases, pool.map(run, cases)))


@pytest.fixture(scope="module")
def runs(baseline, tmp_path_factory):
    """The baseline export as exported, and copies with SGLang's side files (an STS one temperature short)."""
    tmp = tmp_path_factory.mktemp(NAME)
    s = baseline.config.draft.block_size
    cases = {
        "baseline": (baseline.directory, baseline),
        "parse_side": (_side_files(_copy(baseline, tmp / "side"), np.linspace(1.5, 0.5, s)), None),
        "parse_short_sts": (_side_files(_copy(baseline, tmp / "short_sts"), [1.0] * (s - 1)), None),
    }
    return _run_all(cases, tmp)


@pytest.fixture(scope="module")
def more_runs(baseline, memory, vocab, tmp_path_factory):
    """Draft Memory's baseline part, and the broken copies and exports."""
    tmp = tmp_path_factory.mktemp(f"{NAME}_broken")
    cases = {
        "memory": (memory.directory, memory),
        "mask": (
            _copy(baseline, tmp / "mask", lambda c: c.update(mask_token_id=c["mask_token_id"] + 1)),
            baseline,
        ),
        "layers_down": (_copy(baseline, tmp / "layers_down", exports.shift_layers(-1)), baseline),
        "layers_up": (_copy(baseline, tmp / "layers_up", exports.shift_layers(+1)), baseline),
        "loose": (_loose(baseline, tmp / "loose"), baseline),
        "vocab": (vocab.directory, vocab),
    }
    cases["parse_layers_up"] = (cases["layers_up"][0], None)
    return _run_all(cases, tmp)


def _matches(case, runs, export):
    """The case's run loaded the directory strictly and computed the JAX draft's outputs."""
    directory, got, failure = runs[case]
    assert failure is None, failure
    exports.assert_matches(got, export.want)
    assert consumers.check_directory(directory, [NAME]) == []


def test_the_baseline_export_runs_in_sglang_as_the_jax_draft(baseline, runs):
    """SGLang's `load_weights` fills every parameter of its Qwen3DSparkModel from the baseline's main
    directory and leaves no tensor of it unused but the target's embedding and LM head (which SGLang takes
    from the target); its base and Markov logits and confidence logits equal the JAX draft's to RTOL with
    the same predecessors, and the checker finds nothing."""
    _matches("baseline", runs, baseline)


@pytest.mark.slow
def test_draft_memorys_baseline_part_runs_in_sglang_as_the_jax_draft(memory, more_runs):
    """Draft Memory's `--baseline_part` export: SGLang runs its baseline DSpark draft as the JAX baseline part
    computes it, and the checker finds nothing."""
    _matches("memory", more_runs, memory)


def test_sglang_parses_the_config_and_side_files_as_written(baseline, runs):
    """SGLang's parsers on the export's config and the STS and SPS files `side_files` makes: gamma is the
    block size and as many temperatures as its verify planner needs, MASK the draft's row, the aux layers the
    run's (in range of the target), the SPS table a profiled one (its probes merged and sorted); the checker
    finds nothing. An STS calibration one temperature short fails SGLang's gamma check and the checker."""
    directory, got, failure = runs["parse_side"]
    assert failure is None, failure
    draft, aux = baseline.config.draft, list(baseline.config.data.aux_layer_ids)
    assert got["gamma"] == draft.block_size == len(got["sts"]["temperatures"])
    assert got["sts"]["temperatures"] == pytest.approx(np.linspace(1.5, 0.5, draft.block_size).tolist())
    assert got["mask_token_id"] == draft.mask_token_id == exports.MASK_ROW
    assert got["target_layer_ids"] == got["resolved_target_layer_ids"] == aux
    assert (got["markov_rank"], got["markov_head_type"]) == (draft.markov_rank, "vanilla")
    assert got["sps"] == {
        "type": "SpsCostTable",
        "uninitialized": False,
        "sample_batch_tokens": [1, 2, 8, 16],
        "max_batch_tokens": 16,
    }
    assert consumers.check_directory(directory, [NAME]) == []
    directory, _, failure = runs["parse_short_sts"]
    assert f"fit for gamma={draft.block_size - 1} but the runtime gamma is {draft.block_size}" in failure
    problems = consumers.check_directory(directory, [NAME])
    assert len(problems) == 1 and f"one per draft position (block_size={draft.block_size})" in problems[0], (
        problems
    )


def test_a_markov_predecessor_shifted_by_one_is_told_apart(baseline, runs):
    """The JAX draft's Markov logits with each predecessor one slot late differ from SGLang's far beyond
    RTOL: the comparison would catch a predecessor off by one."""
    shifted = dict(baseline.want, markov=baseline.want["markov_shifted"])
    assert exports.differences(runs["baseline"][1], shifted)["markov"] > 100 * exports.RTOL


@pytest.mark.slow
def test_the_wrong_mask_row_changes_sglangs_forward(baseline, more_runs):
    """A copy whose config names MASK + 1: SGLang embeds that row in every block, so its logits no longer
    match. The checker does not catch it: any row of the vocabulary is a valid MASK to a loader, only the
    training run knows which one it used."""
    directory, got, failure = more_runs["mask"]
    assert failure is None, failure
    exports.assert_differs(got, baseline.want)
    assert consumers.check_directory(directory, [NAME]) == []


@pytest.mark.slow
def test_aux_layers_off_by_one_change_sglangs_forward_and_are_flagged_at_the_last_layer(baseline, more_runs):
    """A copy whose target_layer_ids are one lower: SGLang feeds the draft layers k - 1, and its logits no
    longer match; the checker cannot tell (the ids are inner layers of the target). One higher: the last id
    is the target's last layer, which SGLang never captures, and the draft fails at its first forward; the
    checker flags it."""
    directory, got, failure = more_runs["layers_down"]
    assert failure is None, failure
    exports.assert_differs(got, baseline.want)
    assert consumers.check_directory(directory, [NAME]) == []
    directory, got, failure = more_runs["layers_up"]
    assert got is None and "DFLASH target_hidden feature dim mismatch" in failure
    problems = consumers.check_directory(directory, [NAME])
    assert len(problems) == 1 and "taps the target's last layer" in problems[0], problems


@pytest.mark.slow
def test_sglangs_parser_accepts_layers_tapping_the_last_layer_the_checker_flags_them(baseline, more_runs):
    """target_layer_ids [2, 3, 4] on a 5-layer target: SGLang's config parser and its runtime range check
    (ids below the target's layer count) accept them; only the forward finds out (test above), so the
    checker flags the last layer."""
    directory, got, failure = more_runs["parse_layers_up"]
    assert failure is None, failure
    ids = [i + 1 for i in baseline.config.data.aux_layer_ids]
    assert got["target_layer_ids"] == got["resolved_target_layer_ids"] == ids
    assert ids[-1] == got["num_target_layers"] - 1
    assert any("taps the target's last layer" in p for p in consumers.check_directory(directory, [NAME]))


@pytest.mark.slow
def test_a_tensor_too_many_or_too_few_fails_the_strict_load_and_the_checker(more_runs):
    """SGLang's own `load_weights` accepts a file with an unknown backbone tensor and without one of its
    parameters' tensors (the parameter stays as built). The script's strict load names both, as does the
    checker."""
    directory, got, failure = more_runs["loose"]
    assert got is None and "not a strict load" in failure
    assert DROPPED in failure and EXTRA in failure
    problems = consumers.check_directory(directory, [NAME])
    assert any(f"missing tensor {DROPPED}" in p for p in problems), problems
    assert any(f"unexpected tensor {EXTRA}" in p for p in problems), problems


@pytest.mark.slow
def test_a_draft_vocabulary_is_refused_by_sglangs_loader_and_flagged(vocab, more_runs):
    """The main directory of a draft over a 256-token draft vocabulary (exported for vLLM): SGLang's
    `load_weights` refuses its markov_w2 of 256 rows (it builds one row per target token), and the checker
    flags the draft vocabulary."""
    directory, got, failure = more_runs["vocab"]
    assert got is None and "load_weights refused" in failure
    assert f"torch.Size([{exports.DRAFT_VOCAB}, {vocab.config.draft.markov_rank}])" in failure
    problems = consumers.check_directory(directory, [NAME])
    assert len(problems) == 1 and f"draft_vocab_size={exports.DRAFT_VOCAB}" in problems[0], problems
