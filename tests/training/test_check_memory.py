"""AOT memory check: one local device (no `--topology`), a sharded mesh of CPU devices standing in for a
topology, the named topologies and their one-line errors where this host lacks the compiler."""

import jax
import pytest

from configs import baseline
from dspark_jax.training import topology
from dspark_jax.training.aot import step_memory
from tests.test_cli_errors import SMOKE, run

CATEGORIES = (
    "parameters",
    "other_draft_state",
    "optimizer_state",
    "gradient_accumulators",
    "frozen_target",
    "batch",
    "micro_step_temporaries",
    "update_temporaries",
)


def test_one_local_device_counts_every_category():
    """Without devices: today's single-device check; the micro-step's arguments are the categories."""
    report = step_memory(baseline.get_config("smoke"), micro_batch=2)
    per = report["per_device_bytes"]
    assert tuple(per) == CATEGORIES and report["devices"] == 1 and report["global_micro_batch"] == 2
    inputs = per["parameters"] + per["other_draft_state"] + per["frozen_target"] + per["batch"]
    assert report["micro_step"]["argument_size_in_bytes"] == inputs
    assert 0 < per["optimizer_state"] - 2 * per["parameters"] <= 16  # float32 Adam moments and step counts
    assert per["micro_step_temporaries"] == report["micro_step"]["temp_size_in_bytes"] > 0
    assert report["estimated_peak_bytes"] > inputs + per["optimizer_state"]


def test_sharded_devices_split_state_and_batch():
    """The 8 CPU devices as a topology: FSDP shards the weights and their moments, the batch splits."""
    config = baseline.get_config("smoke")
    one = step_memory(config, micro_batch=2)
    eight = step_memory(config, micro_batch=2, devices=jax.devices()[:8])
    per, per1 = eight["per_device_bytes"], one["per_device_bytes"]
    assert eight["devices"] == 8 and eight["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert eight["global_micro_batch"] == 16 and per["batch"] == per1["batch"]  # 2 rows on each device
    assert per["parameters"] < per1["parameters"]
    assert 0 < per["optimizer_state"] - 2 * per["parameters"] <= 16  # the moments laid out like their weights
    # Gradients leave the micro-step on their weights' shards (reduce-scattered; plus the few loss sums).
    sums = per["gradient_accumulators"] - per["parameters"]
    assert 0 < sums <= 4096 and per1["gradient_accumulators"] - per1["parameters"] == sums
    assert per["frozen_target"] * 8 == per1["frozen_target"]  # ('vocab', 'embed'): hidden 64 over fsdp=8


def test_topology_table():
    assert {"tpu-v5p-8", "tpu-v6e-8", "tpu-v5e-8", "h200x8"} <= set(topology.TOPOLOGIES)
    assert topology.get("tpu-v5p-8").num_devices == 4  # v5p-8: 8 TensorCores = 4 megacore chips
    assert topology.get("h200x8").platform == "cuda"
    assert "device_memory_size: 150754820096" in topology.gpu_target_config(topology.get("h200x8"))
    with pytest.raises(ValueError, match="unknown topology 'tpu-v9'; known: tpu-v4-8"):
        topology.get("tpu-v9")


@pytest.mark.parametrize(
    ("name", "platform", "extra"), [("tpu-v5p-8", "tpu", "tpu"), ("h200x8", "cuda", "cuda12-local")]
)
def test_missing_compiler_is_one_error_line_naming_pip(tmp_path, name, platform, extra):
    if topology.has_compiler(platform):
        pytest.skip(f"the {platform} compiler is installed here")
    with pytest.raises(topology.TopologyUnavailable, match=rf"cannot compile for {name} on this host"):
        topology.compile_devices(name)
    proc, errors = run(tmp_path, "check_memory", SMOKE, f"--topology={name}")
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"pip install 'jax[{extra}]=={jax.__version__}'" in errors[0]


def test_unknown_topology_flag(tmp_path):
    proc, _ = run(tmp_path, "check_memory", SMOKE, "--topology=tpu-v9")
    assert proc.returncode != 0 and "tpu-v5p-8" in proc.stderr


@pytest.mark.slow
def test_compiles_for_a_tpu_topology_with_libtpu():
    """Only where libtpu is installed (the `tpu-aot` extra): the smoke step compiled for a v5p-8 slice."""
    if not topology.has_compiler("tpu"):
        pytest.skip("libtpu is not installed (pip install 'dspark_jax[tpu-aot]')")
    report = step_memory(baseline.get_config("smoke"), 2, topology.compile_devices("tpu-v5p-8"))
    assert report["device_kind"] == "TPU v5" and report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    per = report["per_device_bytes"]
    assert 0 < per["optimizer_state"] - 2 * per["parameters"] <= 16
