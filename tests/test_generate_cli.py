"""`python -m dspark_jax.generate` end to end on the smoke target (tiny random model, real tokenizer)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "dspark_jax.generate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_generate_cli_writes_replies_per_turn(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"turns": ["Hello there", "And again?"]}) + "\n" + json.dumps({"turns": ["2+2?"]}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    args = [
        f"--config={ROOT}/configs/baseline.py:smoke",
        f"--input={src}",
        f"--output={out}",
        "--max_new_tokens=6",
        "--config.mesh.fsdp=1",
    ]
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["replies"]) for r in lines] == [2, 1]
    assert all(len(ids) <= 6 for r in lines for ids in r["reply_ids"])
    assert json.loads(proc.stdout.strip().splitlines()[-1])["conversations"] == 2
    first = out.read_text()
    assert _run(*args).returncode == 0 and out.read_text() == first  # greedy is deterministic


def test_generate_cli_rejects_malformed_input(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"turns": ["ok"]}\n{"turns": []}\n')
    proc = _run(
        f"--config={ROOT}/configs/baseline.py:smoke", f"--input={src}", f"--output={tmp_path / 'o.jsonl'}"
    )
    assert proc.returncode != 0
    assert f"{src}:2: expected an object with a non-empty 'turns' list" in proc.stderr
