"""AOT memory check: one local device (no `--topology`), a sharded mesh of CPU devices standing in for a
topology, the named topologies and their one-line errors where this host lacks the compiler; both programs
(the draft's training step, the cache builder's target forward of a hybrid MoE target with its experts
split over the devices); the paper preset's hybrid MoE target and its aux layers."""

import json

import jax
import pytest
from ml_collections import config_dict

from configs import base, baseline
from dspark_jax import sharding
from dspark_jax.errors import UsageError
from dspark_jax.run import config_lib
from dspark_jax.target.config import TargetConfig, from_hf_config
from dspark_jax.training import topology
from dspark_jax.training.aot import step_memory, target_forward_memory
from tests.test_cli_errors import SMOKE, run

CATEGORIES = (
    "parameters",
    "other_draft_state",
    "optimizer_state",
    "gradient_accumulators",
    "frozen_target",
    "online_target_state",
    "batch",
    "micro_step_temporaries",
    "update_temporaries",
)


FORWARD_CATEGORIES = ("expert_parameters", "other_target_state", "batch", "outputs", "temporaries")


def _smoke_hybrid_moe():
    config = baseline.get_config("smoke")
    with config.unlocked():
        config.target.arch = config_dict.ConfigDict(base.SMOKE_HYBRID_TARGET)
    return config


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


def test_the_online_step_holds_the_whole_target_and_reads_token_rows_only():
    """`data.features=online` on 8 devices: the frozen target's every weight sharded by the rules (one
    eighth each), a batch without states, and the draft's activations sharded as offline."""
    config = _smoke_hybrid_moe()
    offline = step_memory(config, micro_batch=2, devices=jax.devices()[:8])
    config.data.features = "online"
    on = step_memory(config, micro_batch=2, devices=jax.devices()[:8])
    per, off = on["per_device_bytes"], offline["per_device_bytes"]
    assert (on["features"], offline["features"]) == ("online", "offline") and off["online_target_state"] == 0
    whole = target_forward_memory(config, rows=1, devices=jax.devices()[:8])["per_device_bytes"]
    assert per["online_target_state"] == whole["expert_parameters"] + whole["other_target_state"] > 0
    assert per["frozen_target"] == off["frozen_target"] and per["parameters"] == off["parameters"]
    t, h, a = config.data.max_length, config.target.arch.hidden_size, len(config.data.aux_layer_ids)
    assert off["batch"] - per["batch"] == 2 * t * h * (a + 1) * 2  # two rows' bf16 states, no more
    # The draft keeps its rows on their batch shards online (the target's residual stream is pinned to
    # them): its temporaries are the offline step's, plus at most the target forward's own, which are
    # freed before the draft's backward. Unpinned, every device computed all 16 rows' draft logits here
    # (+250 MB, 3x the offline step).
    forward = target_forward_memory(config, rows=2, devices=jax.devices()[:8])["per_device_bytes"]
    extra = per["micro_step_temporaries"] - off["micro_step_temporaries"]
    print("online - offline micro-step temporaries:", extra, "target forward's:", forward["temporaries"])
    assert 0 <= extra <= forward["temporaries"]


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


def test_expert_weights_are_sharded_by_the_rules(mesh8):
    """('expert', 'embed', 'mlp') by default: whole experts split over 'fsdp' (the first logical axis takes
    the mesh axis, 'embed' stays whole; expert parallelism), I over 'tensor'; unless 'fsdp' does not divide
    the count, which slices every expert along H instead. A table that maps 'expert' to nothing keeps every
    expert on every device, sliced along H."""
    spec = lambda x, rules=sharding.DEFAULT_RULES: sharding.logical_to_spec(
        ("expert", "embed", "mlp"), (x, 64, 32), mesh8, rules
    )
    experts_everywhere = tuple((n, None if n == "expert" else a) for n, a in sharding.DEFAULT_RULES)
    assert spec(8) == jax.sharding.PartitionSpec("fsdp", None, "tensor")
    assert spec(3) == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert spec(8, experts_everywhere) == jax.sharding.PartitionSpec(None, "fsdp", "tensor")


def test_target_forward_splits_the_experts_over_devices_and_the_bytes_add_up():
    """The cache builder's forward of a hybrid MoE target on 1 and on 8 CPU devices (fsdp=8): each device
    holds one of the 8 experts whole (expert parallelism) and 2 rows of the batch and of the bf16 outputs;
    the categories are the program's arguments, outputs and temporaries."""
    config = _smoke_hybrid_moe()
    one = target_forward_memory(config, rows=2)
    eight = target_forward_memory(config, rows=2, devices=jax.devices()[:8])
    t, h, layers = config.data.max_length, 64, 5
    experts = layers * 3 * 8 * h * 32 * 4  # gate, up, down [X, H, I] per layer, float32
    outputs = 2 * t * (len(config.data.aux_layer_ids) + 1) * h * 2  # 2 rows of aux + last hidden, bf16
    for report, devices in ((one, 1), (eight, 8)):
        per = report["per_device_bytes"]
        assert tuple(per) == FORWARD_CATEGORIES and report["devices"] == devices
        assert report["global_rows"] == 2 * devices and report["tokens_per_row"] == t
        assert per["expert_parameters"] == experts // devices
        assert per["batch"] == 2 * t * (4 + 4) and per["outputs"] == outputs  # int32 tokens + int32 positions
        forward = report["forward"]
        arguments = per["expert_parameters"] + per["other_target_state"] + per["batch"]
        assert forward["argument_size_in_bytes"] == arguments
        table = forward["output_size_in_bytes"] - per["outputs"]  # the output tuple's pointers
        assert 0 <= table <= 64 and report["estimated_peak_bytes"] == sum(per.values()) + table
    assert set(one["expert_sharding"].values()) == {"P(None, None, None)"}
    assert eight["expert_sharding"] == {
        "expert,embed,mlp": "P('fsdp', None, None)",
        "expert,mlp,embed": "P('fsdp', None, None)",
    }
    assert eight["per_device_bytes"]["other_target_state"] < one["per_device_bytes"]["other_target_state"]
    assert one["target_parameters"] == eight["target_parameters"] > experts // 4


def test_paper_target_is_qwen3_next_at_the_seeds_width():
    """`PAPER_TARGET` is what the loader makes of Qwen3-Next-80B-A3B's config (transformers' defaults, with
    that checkpoint's rope_theta, MLP width and context) at hidden size 2560 and 52 layers (13 times its
    pattern); its aux layers 45-47 are inner layers, which every engine captures."""
    from transformers import Qwen3NextConfig

    hf = Qwen3NextConfig(
        num_hidden_layers=52,
        hidden_size=2560,
        intermediate_size=5120,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        eos_token_id=151645,
    )
    paper = baseline.get_config("paper")
    target = TargetConfig.from_json(paper.target.arch.to_dict())
    assert from_hf_config(hf.to_dict()) == target
    assert target.num_layers == 52 and target.num_experts == 512 and target.hidden_size == 2560
    assert paper.data.aux_layer_ids == (45, 46, 47) and paper.draft.mask_token_id < target.vocab_size
    config_lib.validate(paper)


def test_aux_layer_ids_past_the_targets_depth_are_refused():
    config = baseline.get_config("paper")
    with config.unlocked():
        config.data.aux_layer_ids = (50, 51, 52)
    with pytest.raises(
        UsageError, match=r"names layer 52, but the target has 52 decoder layers: use ids -1 .* 50 \(its last"
    ):
        config_lib.validate(config)
    with config.unlocked():
        config.target.path = "/weights/elsewhere"  # a checkpoint's own depth decides (checked when read)
    config_lib.validate(config)


@pytest.mark.parametrize(
    ("flags_", "message"),
    [
        (["--micro_batch=2"], "--micro_batch applies to --program=train_step"),
        (["--forward_rows=0"], "--forward_rows must be >= 1, got 0"),
    ],
)
def test_bad_target_forward_flags_are_one_error_line(tmp_path, flags_, message):
    proc, errors = run(tmp_path, "check_memory", SMOKE, "--program=target_forward", *flags_)
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]


def test_target_forward_command_prints_the_report(tmp_path):
    proc, _ = run(tmp_path, "check_memory", SMOKE, "--program=target_forward", "--forward_rows=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["program"] == "target_forward" and report["global_rows"] == 2
    assert report["expert_sharding"] == {}  # the smoke target is dense


@pytest.mark.slow
def test_target_forward_compiles_for_a_tpu_topology_with_libtpu():
    """Only where libtpu is installed: the hybrid MoE forward for a v5p-8 slice, a quarter of every expert
    on each chip."""
    if not topology.has_compiler("tpu"):
        pytest.skip("libtpu is not installed (pip install 'dspark_jax[tpu-aot]')")
    report = target_forward_memory(_smoke_hybrid_moe(), 1, topology.compile_devices("tpu-v5p-8"))
    assert report["device_kind"] == "TPU v5" and report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert report["expert_sharding"]["expert,embed,mlp"] == "P(None, 'fsdp', None)"
    assert report["per_device_bytes"]["expert_parameters"] == 4 * 3 * 8 * 64 * 32 * 4 // 4


def test_the_targets_last_layer_is_refused_unless_asked_for(caplog):
    """No engine captures the last layer's output: a config tapping it fails before any work, naming the
    engines; `data.tap_last_layer` turns that into a warning, as does a run stored before the key existed
    (a trained draft is still evaluated)."""
    config = baseline.get_config("smoke")
    with config.unlocked():
        config.data.aux_layer_ids = (2, 3, 4)
    with pytest.raises(
        UsageError,
        match=r"taps the target's last layer 4: its output is read by vLLM alone \(deepspec: .*sglang: ",
    ):
        config_lib.validate(config)
    config.data.tap_last_layer = True
    config_lib.validate(config)
    stored = config_lib.to_stored(config)
    del stored["data"]["tap_last_layer"]
    config_lib.validate(config_lib.from_stored(stored))
    assert sum("taps the target's last layer 4" in r.message for r in caplog.records) == 2
    for preset in base.PRESETS:  # every preset taps inner layers
        preset_config = baseline.get_config(preset)
        assert max(preset_config.data.aux_layer_ids) < preset_config.target.arch.num_layers - 1
        config_lib.validate(preset_config)
