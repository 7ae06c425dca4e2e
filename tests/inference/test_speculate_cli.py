"""`speculate` and `evaluate` end to end from a smoke work directory alone (its stored config)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import baseline
from dspark_jax.train.loop import train

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
    assert set(result["cycle_phases_ms"]) == {"draft_ms", "select_ms", "verify_ms", "cycle_ms"}
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
