"""An export its consumers load: weights, config, SGLang's STS and SPS files, TensorRT-LLM's options.

A smoke baseline run gets an STS calibration (fitted by the project's own STS on synthetic blocks) and a
profiled SPS table (`calibrate --profile_sps`'s library call, on this CPU), is exported with `--for=all`
and passes the checker for every consumer (`dspark_jax/interop/consumers/`, whose rules cite the
consumers' code). The consumers' own released code runs on exports in `tests/interop/` (SGLang's parsers
read the STS and SPS files there).

Broken exports (a missing tensor, a bf16 confidence head, a wrong STS length, a bad SPS table or TRT-LLM
schedule, the target's last layer) fail the checker for exactly the consumers that would fail, with a line
naming the problem; a group whose own parameters no engine runs is refused naming them and what the engines
would need, unless its baseline part is asked for alone; a draft vocabulary is refused by name by the
consumers that map none.
"""

import json
import re
import shutil

import numpy as np
import pytest
import yaml
from flax import nnx
from safetensors.numpy import load_file, save_file

from configs import (
    baseline,
    engram_markov,
    engram_mask_gated,
    engram_mask_replace,
    memory,
    reranker_frozen,
    reranker_joint,
)
from dspark_jax import groups
from dspark_jax.data.conversations import PACKAGED_SOURCES
from dspark_jax.interop import consumers
from dspark_jax.interop.consumers import side_files
from dspark_jax.run import checkpoints, deepspec_checkpoint, draft_state
from dspark_jax.run.deepspec_checkpoint import export_draft
from dspark_jax.suite import measure
from dspark_jax.target.checkpoint import default_target_path
from dspark_jax.target.tokenizer import Tokenizer
from tests.marks import tiered
from tests.test_export import _cli, _save_run

S = 7  # the smoke draft's block size


@pytest.mark.parametrize("preset", ["demo", "accel", "smoke"])
def test_every_cpu_preset_drafts_with_a_special_target_row_as_mask(preset):
    """No learned MASK (which no engine loads): SmolLM2's `<empty_output>`, a special token that no packaged
    prompt contains (and that none of the 211k tokens of the demo caches held, `configs/base.py`)."""
    config = baseline.get_config(preset)
    target = deepspec_checkpoint.target_shape(config)
    _, abstract, _ = draft_state.abstract_draft(config, target)
    assert ("mask_embedding",) not in {path for path, _ in nnx.to_flat_state(abstract)}
    assert config.draft.mask_token_id == 16
    tokenizer = Tokenizer.from_gguf(default_target_path())
    assert 16 in tokenizer.special_ids and tokenizer.id_to_token(16) == "<empty_output>"
    for path in PACKAGED_SOURCES.values():
        text = path.read_text()
        assert "<empty_output>" not in text and 16 not in tokenizer.encode(text[:20000]), path


def _calibration(run, step, rng):
    """A calibration record of `step` fitted by the project's STS on synthetic blocks whose acceptance
    follows their confidence logits at temperature 2 (so the fit moves away from 1)."""
    records = []
    for _ in range(4):
        logits = rng.normal(size=(64, S)) * 2
        accept = (rng.random((64, S)) < 1 / (1 + np.exp(-logits / 2))).astype(np.float32)
        records.append(
            {
                "confidence_logit": logits,
                "greedy_accept": accept,
                "overlap": accept,
                "eval_mask": np.ones((64, S)),
            }
        )
    record = {"step": step, "experiment": "baseline", "bins": 10, **measure.fit_and_report(records, 10)}
    path = checkpoints.calibration_file(run, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return record


@pytest.fixture(scope="module")
def served(tmp_path_factory, mesh8):
    """`(tmp, calibration record, SPS table, export directory)`: a smoke run exported with `--for=all`."""
    tmp = tmp_path_factory.mktemp("serving")
    config = baseline.get_config("smoke")  # the preset as it is: its MASK is a target row
    _save_run(config, tmp / "run", mesh8, np.random.default_rng(0))
    record = _calibration(tmp / "run", 3, np.random.default_rng(1))
    _, sps = measure.profile_serving_sps(
        config, tmp / "run", rows=(1, 2), cache_slots=64, mesh=mesh8, repeats=2
    )
    proc, errors = _cli(tmp, "export", f"--checkpoint={tmp / 'run'}", f"--output={tmp / 'out'}", "--for=all")
    assert proc.returncode == 0 and not errors, proc.stderr[-3000:]
    assert "loads in deepspec, vllm, sglang, trtllm, sglang_jax, specforge, speculators" in proc.stdout
    return tmp, record, sps, tmp / "out"


def test_the_export_holds_every_engines_files_and_passes_the_checker(served):
    _, record, sps, out = served
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        side_files.STS_FILE,
        side_files.SPS_FILE,
        side_files.TRTLLM_FILE,
    } <= names
    assert consumers.check_directory(out) == []
    sts = json.loads((out / side_files.STS_FILE).read_text())
    assert sts["temperatures"] == record["temperatures"]["greedy"] and len(sts["temperatures"]) == S
    assert sts["ece_after"] == record["ece"]["greedy"]["held_out"]["after"] and sts["mode"] == "greedy"
    assert sts["temperatures"] != [1.0] * S  # a real fit, not the identity
    table = json.loads((out / side_files.SPS_FILE).read_text())
    assert table == sps and "cpu" in table["device"].lower()
    assert table["sample_batch_tokens"] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]  # 1 x 1..8, 2 x 1..8
    assert table["max_batch_tokens"] == 2 * (S + 1)
    spec = yaml.safe_load((out / side_files.TRTLLM_FILE).read_text())["speculative_config"]
    assert spec["decoding_type"] == "DSpark" and spec["max_draft_len"] == spec["block_size"] == S
    assert spec["mask_token_id"] == 16 and spec["speculative_model_dir"] == str(out.resolve())
    assert set(spec["draft_len_schedule"]) == {1, 2} and spec["draft_len_schedule"][1] == S


def test_the_config_reads_as_each_engine_reads_it(served):
    out = served[3]
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3"
    assert (c["mask_token_id"], c["markov_head_type"], c["block_size"]) == (16, "vanilla", S)
    assert c["num_target_layers"] == 5 and c["target_layer_ids"] == [1, 2, 3]  # inner layers
    assert "sliding_attention" not in c["layer_types"]  # vLLM: full-attention layers run non-causal
    assert c["dspark_jax"] == {
        "experiment": "baseline",
        "step": 3,
        "baseline_part_only": False,
        "left_out": [],
    }
    weights = load_file(out / "model.safetensors")
    assert weights["confidence_head.proj.weight"].dtype == np.float32


def _broken(served, name, edit):
    tmp, out = served[0], served[3]
    broken = tmp / name
    if broken.exists():
        shutil.rmtree(broken)
    shutil.copytree(out, broken)
    edit(broken)
    return consumers.check_directory(broken)


def _edit_weights(change):
    def edit(directory):
        tensors = load_file(directory / "model.safetensors")
        change(tensors)
        save_file(tensors, directory / "model.safetensors")

    return edit


def _edit_json(name, change):
    def edit(directory):
        doc = json.loads((directory / name).read_text())
        change(doc)
        (directory / name).write_text(json.dumps(doc))

    return edit


def _edit_yaml(change):
    def edit(directory):
        doc = yaml.safe_load((directory / side_files.TRTLLM_FILE).read_text())
        change(doc["speculative_config"])
        (directory / side_files.TRTLLM_FILE).write_text(yaml.safe_dump(doc))

    return edit


MAIN = ("deepspec", "vllm", "sglang", "trtllm", "sglang_jax")  # the consumers reading the main directory
FLOAT32_CONFIDENCE = ("vllm", "sglang", "trtllm")
# case -> (edit of the main directory, a fragment of every expected line, the consumers expected to flag it)
BROKEN = {
    "missing tensor": (
        _edit_weights(lambda t: t.pop("layers.1.mlp.down_proj.weight")),
        "missing tensor layers.1.mlp.down_proj.weight",
        MAIN,
    ),
    "bf16 confidence head": (
        _edit_weights(
            lambda t: t.update(
                {"confidence_head.proj.weight": t["confidence_head.proj.weight"].astype("bfloat16")}
            )
        ),
        "tensor confidence_head.proj.weight is BF16, the loader reads F32",
        FLOAT32_CONFIDENCE,
    ),
    "wrong STS length": (
        _edit_json(side_files.STS_FILE, lambda d: d["temperatures"].pop()),
        "sts_calibration.json: 6 temperatures, SGLang needs one per draft position (block_size=7)",
        ("sglang",),
    ),
    "non-positive temperature": (
        _edit_json(side_files.STS_FILE, lambda d: d["temperatures"].__setitem__(0, 0.0)),
        "sts_calibration.json: temperatures=",
        ("sglang",),
    ),
    "unsorted SPS probes": (
        _edit_json(side_files.SPS_FILE, lambda d: d["sample_batch_tokens"].reverse()),
        "sample_batch_tokens [16, 14,",
        ("sglang",),
    ),
    "SPS max below its probes": (
        _edit_json(side_files.SPS_FILE, lambda d: d.update(max_batch_tokens=3)),
        "max_batch_tokens=3 below the largest probe 16",
        ("sglang",),
    ),
    "learned MASK (no row)": (
        _edit_json("config.json", lambda d: d.update(mask_token_id=-1)),
        "mask_token_id=-1 outside the vocabulary",
        MAIN,
    ),
    "causal layers": (
        _edit_json("config.json", lambda d: d.update(layer_types=["sliding_attention"] * 3)),
        "causal attention (sliding layers [0, 1, 2])",
        MAIN,
    ),
    "markov rank in a sub-config only": (  # SGLang reads dflash_config before the top level
        _edit_json("config.json", lambda d: d.update(dflash_config={"markov_rank": d.pop("markov_rank")})),
        "markov_rank=None: a positive integer at the top level is required",
        ("deepspec", "vllm", "trtllm", "sglang_jax"),
    ),
    "the target's last layer": (
        _edit_json("config.json", lambda d: d.update(target_layer_ids=[2, 3, 4])),
        "taps the target's last layer 4",
        ("deepspec", "sglang", "sglang_jax"),  # vLLM captures it (raw, after the last layer)
    ),
    "TRT-LLM schedule not starting at the full length": (
        _edit_yaml(lambda s: s.update(draft_len_schedule={1: 3, 4: 2})),
        "draft_len_schedule[1]=3: the smallest batch size must map to max_draft_len=7",
        ("trtllm",),
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_export_fails_the_checker_naming_the_problem(served, case):
    """The main directory broken one way: exactly the consumers whose loaders would fail say so (the
    trainers read their own directories, unbroken here)."""
    edit, fragment, expected = BROKEN[case]
    problems = _broken(served, case.replace(" ", "_"), edit)
    flagged = {line.split(":")[0] for line in problems if fragment in line}
    assert flagged == set(expected), (fragment, problems)
    assert {line.split(":")[0] for line in problems} <= set(MAIN), problems


def test_the_check_command_lists_problems_and_exits_1(served):
    tmp = served[0]
    _broken(served, "cli_broken", BROKEN["missing tensor"][0])
    proc, errors = _cli(tmp, "export", f"--check={tmp / 'cli_broken'}", "--for=sglang")
    assert proc.returncode == 1 and len(errors) == 1 and "1 problems for sglang" in errors[0], proc.stderr[
        -2000:
    ]
    assert proc.stdout.splitlines()[0].startswith(
        "sglang: weights: missing tensor layers.1.mlp.down_proj.weight"
    )
    proc, errors = _cli(tmp, "export", f"--check={served[3]}")
    assert (
        proc.returncode == 0
        and "loads in deepspec, vllm, sglang, trtllm, sglang_jax, specforge, speculators" in proc.stdout
    ), proc.stderr[-2000:]
    proc, errors = _cli(tmp, "export", f"--check={served[3]}", "--for=tgi")
    assert proc.returncode == 2 and "--for is wrong: unknown consumer tgi" in errors[0]


def _main_only(directory):
    """The main directory alone: what a trainer's loader meets when pointed at it."""
    for sub in ("specforge", "speculators"):
        shutil.rmtree(directory / sub)


# The four ways the exports of 2026-12-06 failed in the consumers' own code: each consumer's check names it
# and the fix (issue 48). `--for`, the edit of the export's copy, and the consumer's line.
CONSUMER_FAILURES = {
    "specforge reads the main directory": (
        "specforge",
        _main_only,
        r"^specforge: config.json: no dflash_config: SpecForge reads the DSpark keys only there.*"
        r"export --for=specforge",
    ),
    "speculators reads the main directory": (
        "speculators",
        _main_only,
        r"^speculators: config.json: speculators_model_type=None: .*auto-conversion.*"
        r"export --for=speculators",
    ),
    "aux layers tapping the target's last layer": (
        "sglang",
        _edit_json("config.json", lambda d: d.update(target_layer_ids=[2, 3, 4])),
        r"^sglang: config.json: target_layer_ids=\[2, 3, 4\] taps the target's last layer 4, whose output "
        r"SGLang captures at the input of layer k \+ 1.*retrain on inner layers \(data.aux_layer_ids\)",
    ),
    "a draft vocabulary": (
        "sglang",
        _edit_json("config.json", lambda d: d.update(draft_vocab_size=256)),
        r"^sglang: config.json: draft_vocab_size=256: SGLang's markov_w2 covers the whole vocabulary; train "
        r"with train.draft_vocab=0",
    ),
}


@pytest.mark.parametrize("case", list(CONSUMER_FAILURES))
def test_the_check_command_refuses_what_failed_in_the_consumers_naming_the_fix(served, case):
    name, edit, line = CONSUMER_FAILURES[case]
    tmp, folder = served[0], case.replace(" ", "_").replace("'", "")
    _broken(served, folder, edit)
    proc, errors = _cli(tmp, "export", f"--check={tmp / folder}", f"--for={name}")
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-2000:]
    assert f"for {name} (listed above)" in errors[0], errors
    assert any(re.search(line, out) for out in proc.stdout.splitlines()), proc.stdout


GROUP_CONFIGS = {
    "engram_markov": engram_markov,
    "engram_mask_gated": engram_mask_gated,
    "engram_mask_replace": engram_mask_replace,
    "memory": memory,
    "reranker_joint": reranker_joint,
    "reranker_frozen": reranker_frozen,
}


@pytest.mark.parametrize("group", list(GROUP_CONFIGS))
def test_a_group_no_engine_runs_is_refused_naming_what_is_missing_where(group, tmp_path):
    """Refused before any checkpoint is read (the path does not exist), with the group's own parameters
    and what vLLM, SGLang and TensorRT-LLM would need (the group's `serving_gap`)."""
    config = GROUP_CONFIGS[group].get_config("smoke")
    with pytest.raises(ValueError) as error:
        export_draft(config, tmp_path / "no_run", tmp_path / "out")
    message = str(error.value)
    assert f"experiment group {group!r}: parameters " in message and "\n" not in message
    assert (
        "vLLM (Qwen3DSparkForCausalLM), SGLang (Qwen3DSparkModel) and TensorRT-LLM (DSpark) would need"
        in message
    )
    gap = groups.get(group).run.serving_gap
    assert gap and gap in message and "--baseline_part" in message
    assert not (tmp_path / "out").exists()


def test_a_draft_vocabulary_is_refused_by_name_where_no_consumer_maps_it(tmp_path):
    """Named consumers that map no draft vocabulary refuse it before the checkpoint or a cache is read (the
    path does not exist), each naming why and the fix; the draft's export for vLLM and speculators:
    `tests/interop/`."""
    config = baseline.get_config("smoke")
    config.train.draft_vocab = 64
    with pytest.raises(ValueError) as error:
        export_draft(config, tmp_path / "no_run", tmp_path / "out", consumers_text="vllm,sglang,specforge")
    message = str(error.value)
    assert message.startswith(
        "sglang cannot run this draft: SGLang's Markov head covers the whole vocabulary"
    )
    assert "specforge cannot run this draft" in message and "vllm" not in message.split(":")[0]
    assert message.count("train.draft_vocab=0") == 2 and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_the_baseline_part_of_a_group_exports_when_asked_and_says_so(served, mesh8):
    tmp = served[0]
    config = memory.get_config("smoke")
    _save_run(config, tmp / "memory_run", mesh8, np.random.default_rng(2))
    proc, errors = _cli(tmp, "export", f"--checkpoint={tmp / 'memory_run'}", f"--output={tmp / 'memory_out'}")
    assert proc.returncode == 1 and len(errors) == 1 and "memory_adapter.*" in errors[0], proc.stderr[-2000:]
    assert not (tmp / "memory_out").exists()
    args = (f"--checkpoint={tmp / 'memory_run'}", f"--output={tmp / 'memory_out'}", "--baseline_part")
    proc, errors = _cli(tmp, "export", *args, "--for=vllm,sglang")
    assert proc.returncode == 0 and not errors, proc.stderr[-2000:]
    c = json.loads((tmp / "memory_out" / "config.json").read_text())
    assert c["dspark_jax"] == {
        "experiment": "memory",
        "step": 3,
        "baseline_part_only": True,
        "left_out": ["memory_adapter.*"],
    }
    assert consumers.check_directory(tmp / "memory_out", ("vllm", "sglang")) == []
    assert not (tmp / "memory_out" / side_files.TRTLLM_FILE).exists()  # not asked for
    assert not any(k.startswith("memory") for k in load_file(tmp / "memory_out" / "model.safetensors"))


@pytest.mark.parametrize(
    "group",
    tiered([g for g in GROUP_CONFIGS if g != "memory"], fast=["engram_markov", "reranker_frozen"]),
)
def test_every_groups_baseline_part_exports_and_loads(group, served, mesh8):
    """In process (the memory group goes through the command above): the baseline DSpark tensors of the
    group's draft, the group's own parameters left out and named in config.json."""
    tmp = served[0]
    config = GROUP_CONFIGS[group].get_config("smoke")
    _save_run(config, tmp / f"{group}_run", mesh8, np.random.default_rng(4))
    out, _, _ = export_draft(config, tmp / f"{group}_run", tmp / f"{group}_out", baseline_part=True)
    record = json.loads((out / "config.json").read_text())["dspark_jax"]
    assert record["experiment"] == group and record["baseline_part_only"] and record["left_out"]
    assert consumers.check_directory(out) == []


def test_the_draft_length_schedule_maximises_expected_throughput_by_hand():
    """Verification is free up to 8 tokens, then halves by 16 and drops to 10/s by 64; acceptance falls
    fast. Batch 2: k = 3 fills 8 tokens at 100/s (2 x 1.85 x 100 = 370) and k = 4 already pays (2 x 1.9 x
    87.5 = 332.5); batch 8: k = 0 (8 x 100 = 800) beats k = 1 (8 x 1.5 x 50 = 600); batch 1 maps to the
    full block, as TensorRT-LLM requires of the smallest batch size."""
    survival = [0.5, 0.25, 0.1, 0.05, 0.02, 0.01, 0.005]
    sps = {"sample_batch_tokens": [1, 8, 16, 64], "sample_steps_per_sec": [100.0, 100.0, 50.0, 10.0]}
    assert side_files.draft_len_schedule(survival, sps, [8, 1, 2], S) == {1: S, 2: 3, 8: 0}
