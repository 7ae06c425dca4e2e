"""User errors on the command line: one `error:` line, exit status 2 for usage errors, before any work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import compilation_cache

ROOT = Path(__file__).resolve().parents[1]
SMOKE = f"--config={ROOT}/configs/baseline.py:smoke"
ENGRAM = f"--config={ROOT}/configs/engram_markov.py:smoke"
FROZEN = f"--config={ROOT}/configs/reranker_frozen.py:smoke"


def run(tmp_path, module, *args):
    env = {
        **compilation_cache.ENV,
        "DSPARK_JAX_CACHE": str(tmp_path / "cache"),
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
    }
    cmd = [sys.executable, "-m", f"dspark_jax.{module}", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    return proc, errors


@pytest.mark.parametrize(
    ("module", "args", "status", "message"),
    [
        (
            "train",
            [SMOKE, "--config.train.grad_acum=2"],
            2,
            r"--config.train.grad_acum: train.grad_acum is not a key of .*; nearest: train.grad_accum",
        ),
        ("train", [SMOKE, "--config.train.grad_accum=3"], 2, r"train.global_batch=2 is not divisible"),
        (
            "train",
            [SMOKE, "--config.data.aux_layer_ids=(2,3,4)"],
            2,
            r"aux_layer_ids=\(2, 3, 4\) taps the target's last layer 4: .*sglang: SGLang captures at the "
            r"input of layer k \+ 1.*aux_layer_ids=\"\(1, 2, 3\)\".*data.tap_last_layer=True",
        ),
        (
            "train",
            [SMOKE, "--config.init.from_target_layers=(0,1)"],
            2,
            r"init.from_target_layers=\(0, 1\) names 2 target layers; the draft has draft.num_layers=3",
        ),
        (
            "train",
            [SMOKE, "--config.experiment=nope"],
            2,
            r"config.experiment='nope' is not a registered group",
        ),
        ("train", [SMOKE, "--workdir=notes.txt"], 2, r"--workdir .*/notes.txt is a file"),
        ("speculate", ["--checkpoint=nowhere", "--max_new_tokens=0"], 2, r"--max_new_tokens must be >= 1"),
        (
            "speculate",
            ["--checkpoint=nowhere", "--input=missing.jsonl"],
            2,
            r"--input .*/missing.jsonl does not",
        ),
        ("evaluate", ["--checkpoint=nowhere"], 1, r"checkpoint path not found: .*/nowhere"),
        ("check_memory", [SMOKE, "--config.draft.num_heads=3"], 2, r"draft.num_heads=3 is not a multiple"),
        ("build_cache", [SMOKE, "--config.data.regen_max_turns=0"], 2, r"data.regen_max_turns=0 must be"),
        ("train", [ENGRAM, "--config.engram.fit_offset=2"], 2, r"engram.fit_offset=2 overlaps the training"),
        (
            "fit_engram",
            [ENGRAM, "--config.engram.fit_source=", "--config.engram.table_path=none.safetensors"],
            2,
            r"Engram table .*/none.safetensors does not exist and cannot be fitted here",
        ),
        (
            "train",
            [ENGRAM, "--config.engram.table_path=notes.txt"],
            1,
            r"notes.txt is corrupt or not a table",
        ),
        (
            "train",
            [FROZEN, "--config.init.checkpoint=no_run"],
            2,
            r"config.init.checkpoint: checkpoint path not found: .*/no_run",
        ),
    ],
)
def test_one_line_error_before_any_work(tmp_path, module, args, status, message):
    (tmp_path / "notes.txt").write_text("not a directory")
    proc, errors = run(tmp_path, module, *args)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(message, errors[0]), errors[0]
    assert not (tmp_path / "cache").exists()  # no cache was prepared, no target loaded


def test_verbose_keeps_the_traceback(tmp_path):
    proc, _ = run(tmp_path, "evaluate", "--checkpoint=nowhere", "--verbose")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
