"""Print the AOT memory analysis of one device's share of a program (see `dspark_jax.training.aot`).

python -m dspark_jax.check_memory --config=configs/baseline.py:paper [--micro_batch=4]
python -m dspark_jax.check_memory --config=configs/baseline.py:paper --topology=tpu-v5p-8
python -m dspark_jax.check_memory --config=configs/baseline.py:paper --topology=h200x8 \\
    --program=target_forward [--forward_rows=1]

`--program` picks what is compiled: `train_step` (the draft's micro-step and optimizer update, `--micro_batch`
rows per batch shard) or `target_forward` (the cache builder's forward of the whole target of shape
`target.arch`, no weights read, `--forward_rows` rows of `data.max_length` tokens per batch shard).
`--topology` compiles for a named slice (`dspark_jax.training.topology.TOPOLOGIES`) on this host with that
platform's compiler (the `tpu-aot` / `gpu-aot` extras) and adds whether the program fits the device's
nominal memory; where the compiler is missing it prints one `error:` line naming the pip command and
exits 1.
"""

from __future__ import annotations

import json

import jax
from absl import flags

from dspark_jax.cli import check_flags, config_value, define_config_flag, run
from dspark_jax.training import topology as topology_lib
from dspark_jax.training.aot import GB, PROGRAMS, step_memory, target_forward_memory

_CONFIG = define_config_flag()
_PROGRAM = flags.DEFINE_enum(
    "program",
    "train_step",
    list(PROGRAMS),
    "What to compile: the draft's training step, or the cache builder's target forward.",
)
_MICRO_BATCH = flags.DEFINE_integer(
    "micro_batch", 4, "train_step: samples per batch shard (device) per micro-step."
)
_FORWARD_ROWS = flags.DEFINE_integer(
    "forward_rows", 1, "target_forward: rows of data.max_length tokens per batch shard (device)."
)
_TOPOLOGY = flags.DEFINE_enum(
    "topology",
    None,
    list(topology_lib.TOPOLOGIES),
    "Compile for this slice instead of one local device (needs the platform's compiler).",
)
# The batch flag each program reads; the other one is refused when given.
_BATCH_FLAG = {"train_step": _MICRO_BATCH, "target_forward": _FORWARD_ROWS}


def main(argv):
    del argv
    program = _PROGRAM.value
    for name, flag in _BATCH_FLAG.items():
        if name != program:
            check_flags(**{flag.name: (not flags.FLAGS[flag.name].present, f"applies to --program={name}")})
    rows = _BATCH_FLAG[program].value
    check_flags(**{_BATCH_FLAG[program].name: (rows >= 1, f"must be >= 1, got {rows}")})
    measure = step_memory if program == "train_step" else target_forward_memory
    if _TOPOLOGY.value is None:
        print(json.dumps(measure(config_value(_CONFIG), rows), indent=2))
        return
    # Compile-only devices: the local backend stays the CPU (no local accelerator is claimed, and the
    # CUDA plugin registers its compiler without a driver). Set before any backend starts.
    jax.config.update("jax_platforms", "cpu")
    config = config_value(_CONFIG)
    target = topology_lib.get(_TOPOLOGY.value)
    report = measure(config, rows, topology_lib.compile_devices(_TOPOLOGY.value))
    peak = report["estimated_peak_bytes"]
    report = {"topology": _TOPOLOGY.value, "platform": target.platform, "topology_name": target.name} | report
    report |= {
        "device_memory_bytes": target.memory_bytes,
        "device_memory_gb": round(target.memory_bytes / GB, 2),
        "fits": peak <= target.memory_bytes,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    run(main)
