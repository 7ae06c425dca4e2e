"""Multi-process start-up: `jax.distributed.initialize` where the launch has several processes."""

from __future__ import annotations

import os

import jax


def multi_process_launch() -> bool:
    """True on a multi-process launch (Slurm with several tasks, a multi-worker TPU VM, or explicit)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def initialize_distributed() -> None:
    """`jax.distributed.initialize`, explicit when `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` are set (local
    multi-process runs, e.g. two CPU processes on one machine), else detected (Slurm, TPU VM). CPU
    processes exchange collectives through gloo."""
    if "JAX_NUM_PROCESSES" not in os.environ or "JAX_PROCESS_ID" not in os.environ:
        jax.distributed.initialize()
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # read by the CPU client only
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
