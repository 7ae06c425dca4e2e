"""Two processes building one smoke cache at once end with one valid cache, never interleaved records."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import base
from dspark_jax import cache
from dspark_jax.data.regenerate import read_output
from dspark_jax.run.caches import cache_path, replies_path
from dspark_jax.target import target_from_config
from tests import compilation_cache

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_builders_of_one_cache_end_with_one_valid_cache(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dspark_jax.build_cache",
        f"--config={ROOT}/configs/baseline.py:smoke",
        f"--config.data.cache_dir={tmp_path / 'caches'}",
        "--config.mesh.fsdp=1",
    ]
    env = {
        **compilation_cache.ENV,
        "DSPARK_JAX_CACHE": str(tmp_path / "local"),
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
    }
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ]
    procs.append(
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    )
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    reports = [[json.loads(line) for line in out.splitlines()] for out, _ in outputs]
    assert reports[0] == reports[1]  # both saw the same finished caches
    assert any("being built by another process" in err for _, err in outputs)  # one of them waited

    config = base.get_config("smoke")
    config.data.cache_dir = str(tmp_path / "caches")
    fingerprint = target_from_config(config.target, seed=config.seed).fingerprint
    for split in ("train", "val"):
        records = read_output(replies_path(config, fingerprint, split))  # indices 0..n-1, once each
        samples = cache.verify(cache_path(config, fingerprint, split))
        report = next(r for r in reports[0] if r["split"] == split)
        assert len(records) == report["conversations"] and samples == report["samples"]
