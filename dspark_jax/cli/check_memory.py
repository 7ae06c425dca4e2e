"""Print the AOT memory analysis of one device's training step (see `dspark_jax.training.aot`).

python -m dspark_jax.check_memory --config=configs/baseline.py:paper [--micro_batch=4]
python -m dspark_jax.check_memory --config=configs/baseline.py:paper --topology=tpu-v5p-8

`--topology` compiles for a named slice (`dspark_jax.training.topology.TOPOLOGIES`) on this host with that
platform's compiler (the `tpu-aot` / `gpu-aot` extras) and adds whether the step fits the device's
nominal memory; where the compiler is missing it prints one `error:` line naming the pip command and
exits 1.
"""

from __future__ import annotations

import json

import jax
from absl import flags

from dspark_jax.cli.common import check_flags, config_value, define_config_flag, run
from dspark_jax.training import topology as topology_lib
from dspark_jax.training.aot import GB, step_memory

_CONFIG = define_config_flag()
_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 4, "Samples per batch shard (device) per micro-step.")
_TOPOLOGY = flags.DEFINE_enum(
    "topology",
    None,
    list(topology_lib.TOPOLOGIES),
    "Compile for this slice instead of one local device (needs the platform's compiler).",
)


def main(argv):
    del argv
    check_flags(micro_batch=(_MICRO_BATCH.value >= 1, f"must be >= 1, got {_MICRO_BATCH.value}"))
    if _TOPOLOGY.value is None:
        print(json.dumps(step_memory(config_value(_CONFIG), _MICRO_BATCH.value), indent=2))
        return
    # Compile-only devices: the local backend stays the CPU (no local accelerator is claimed, and the
    # CUDA plugin registers its compiler without a driver). Set before any backend starts.
    jax.config.update("jax_platforms", "cpu")
    config = config_value(_CONFIG)
    target = topology_lib.get(_TOPOLOGY.value)
    report = step_memory(config, _MICRO_BATCH.value, topology_lib.compile_devices(_TOPOLOGY.value))
    peak = report["estimated_peak_bytes"]
    report = {"topology": _TOPOLOGY.value, "platform": target.platform, "topology_name": target.name} | report
    report |= {
        "device_memory_bytes": target.memory_bytes,
        "device_memory_gb": round(target.memory_bytes / GB, 2),
        "fits": peak <= target.memory_bytes,
    }
    print(json.dumps(report, indent=2))


def launch() -> None:
    """The command: flags parsed, errors as one line (`cli.common.run`)."""
    run(main)


if __name__ == "__main__":
    launch()
