"""`speculate` and `evaluate` end to end from a smoke work directory alone (its stored config)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import baseline
from dspark_jax.training.loop import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_speculate_cli_reports_mal_and_matches_target_greedy(tmp_path):
    config = baseline.get_config("smoke")
    config.data.cache_dir = str(tmp_path / "caches")
    config.mesh.fsdp = 1
    config.train.stop_step = config.train.total_steps = 2
    train(config, tmp_path / "work")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"turns": [q]}) + "\n" for q in ("Hi!", "What is 2+2?", "Name a colour."))
    )
    out = tmp_path / "spec.json"
    cmd = [
        sys.executable,
        "-m",
        "dspark_jax.speculate",
        f"--checkpoint={tmp_path / 'work'}",
        f"--input={prompts}",
        f"--output={out}",
        "--max_new_tokens=8",
        "--concurrency=2",
        "--offline",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["identical_to_target_greedy"] == "3/3"
    spec = result["speculative"]
    assert spec["requests"] == 3 and spec["cycles"] > 0 and 1.0 <= spec["mal_pooled"] <= 8.0
    phases = result["cycle_phases_ms"]
    assert set(phases) == {
        *("draft_ms", "select_ms", "verify_ms", "cycle_ms", "prefill_ms"),
        *("verify_forward_ms", "draft_forward_ms", "lm_head_ms", "floor_ms"),
    }
    assert phases["floor_ms"] == pytest.approx(
        phases["verify_forward_ms"] + phases["draft_forward_ms"] + phases["lm_head_ms"]
    )
    assert result["target_only"]["tokens_per_second"] > 0 and result["speedup"] > 0
    assert 1.0 <= result["offline"]["tau_prob"] <= 8.0
    assert [len(r["reply_ids"]) for r in result["requests"]] == [1, 1, 1]

    evaluate = [sys.executable, "-m", "dspark_jax.evaluate", f"--checkpoint={tmp_path / 'work'}"]
    proc = subprocess.run(evaluate, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert offline["step"] == 2 and offline["tau_prob"] == result["offline"]["tau_prob"]
    # A --config that would build a different draft is refused, naming the key, before any work.
    mismatch = [*evaluate, f"--config={ROOT}/configs/baseline.py:smoke", "--config.draft.markov_rank=16"]
    proc = subprocess.run(mismatch, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "draft.markov_rank" in proc.stderr, proc.stderr[-2000:]
    # --memory_source is for Draft Memory checkpoints only.
    proc = subprocess.run([*cmd, "--memory_source=no_memory"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--memory_source applies to checkpoints of" in proc.stderr, proc.stderr[
        -2000:
    ]
    # --draft_len beyond the draft's block is refused before the target loads.
    proc = subprocess.run([*cmd, "--draft_len=8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--draft_len must be in 0..7" in proc.stderr, proc.stderr[-2000:]
    # A draft vocabulary of the 64 tokens the run's training replies use most (and EOS): still lossless.
    proc = subprocess.run(
        [*cmd[:-1], "--draft_vocab=64"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "draft vocabulary: " in proc.stderr, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["identical_to_target_greedy"] == "3/3" and result["settings"]["draft_vocab_size"] in (
        64,
        65,
    )
    # The prefix scheduler needs the STS calibration first; then it decodes losslessly and reports.
    scheduled = [*cmd[:-1], "--schedule=confidence"]  # without --offline
    proc = subprocess.run(scheduled, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "python -m dspark_jax.calibrate --checkpoint=" in proc.stderr, (
        proc.stderr[-2000:]
    )
    calibrate = [sys.executable, "-m", "dspark_jax.calibrate", f"--checkpoint={tmp_path / 'work'}"]
    proc = subprocess.run(calibrate, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sts = tmp_path / "work" / "calibration" / "step_2"
    record = json.loads((sts / "sts.json").read_text())
    assert record["step"] == 2 and record["blocks"]["fit"] > 0
    for mode in ("greedy", "sampling"):
        assert len(record["temperatures"][mode]) == 7 and min(record["temperatures"][mode]) > 0
        assert len(record["ece"][mode]["held_out"]["after"]) == 7
        assert (sts / f"reliability_{mode}.png").stat().st_size > 0
    proc = subprocess.run(scheduled, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["identical_to_target_greedy"] == "3/3" and result["settings"]["schedule"] == "confidence"
    assert result["settings"]["confidence_temperatures"] == record["temperatures"]["greedy"]
    assert len(result["sps_table"]["sps"]) == 4 and 0 <= result["speculative"]["mean_verified_length"] <= 7


@pytest.mark.slow
def test_draft_memory_main_job_smoke_and_speculation_with_both_sources(tmp_path):
    """`train --config=configs/memory.py:smoke` from the command line, then greedy speculation with
    either memory source equals target-only greedy; the checkpoint under the baseline config is refused."""
    work = tmp_path / "work"
    train_cmd = [
        sys.executable,
        "-m",
        "dspark_jax.train",
        f"--config={ROOT}/configs/memory.py:smoke",
        f"--workdir={work}",
        f"--config.data.cache_dir={tmp_path / 'caches'}",
        "--config.train.stop_step=2",
        "--json",
    ]
    proc = subprocess.run(train_cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout[proc.stdout.index("{") :])
    for name in ("stage1_mean_matches", "memory_block_fraction", "memory_mean_length", "transition_kept"):
        assert f"train/{name}" in metrics and f"eval/{name}" in metrics, name
    for source in ("with_memory", "no_memory"):
        out = tmp_path / f"{source}.json"
        cmd = [
            sys.executable,
            "-m",
            "dspark_jax.speculate",
            f"--checkpoint={work}",
            f"--output={out}",
            "--limit=3",
            "--max_new_tokens=8",
            f"--memory_source={source}",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(out.read_text())
        assert result["identical_to_target_greedy"] == "3/3"
        assert result["settings"]["memory_source"] == source
    baseline_config = [*cmd[:4], f"--config={ROOT}/configs/baseline.py:smoke"]
    proc = subprocess.run(baseline_config, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "on experiment: given 'baseline', stored 'memory'" in proc.stderr, (
        proc.stderr[-2000:]
    )
