"""Named accelerator topologies for ahead-of-time compilation without the hardware.

  python -m dspark_jax.check_memory --config=configs/baseline.py:paper --topology=tpu-v5p-8

`compile_devices(name)` returns compile-only devices of a named slice (`TOPOLOGIES`) through
`jax.experimental.topologies`: the program is lowered and compiled by the target's own compiler on
this host, nothing runs. That needs the target's compiler as a library:

- TPU: libtpu (the `tpu-aot` extra, `jax[tpu]`, which pins the libtpu matched to the installed JAX);
- NVIDIA GPU: JAX's CUDA plugin without the CUDA libraries (the `gpu-aot` extra, `jax[cuda12-local]`),
  given a target description of the GPU (`gpu_target_config`) instead of a driver to ask.

Without it `compile_devices` raises `TopologyUnavailable`: one line with JAX's reason and the pip
command. Either toolchain works on a CPU-only host with `JAX_PLATFORMS=cpu` (`check_memory` sets it
for `--topology`, so no local accelerator is claimed and the CUDA plugin skips its driver checks).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax
from jax.experimental import topologies

GIB = 2**30


class TopologyUnavailable(ValueError):
    """This host lacks the compiler of a named topology (CLIs: one `error:` line, status 1)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """One slice: `jax.experimental.topologies` arguments, its device count and nominal memory.

    Attributes:
      platform: 'tpu' or 'cuda'.
      name: the platform's topology string (`v5:2x2x1` chips for TPU; `slices x hosts x GPUs` for CUDA).
      num_devices: JAX devices of the slice (a v5p or v4 megacore chip is one device).
      memory_bytes: nominal memory of one device (HBM), for the fits/does-not-fit line.
      chip_config: TPU chip configuration ('default', or 'megacore' for v4 and v5p).
      chips_per_host: TPU chips per host along each axis.
      device_name: CUDA device description (GPU target config).
      memory_bandwidth: bytes/s of one GPU (GPU target config).
    """

    platform: str
    name: str
    num_devices: int
    memory_bytes: int
    chip_config: str = "default"
    chips_per_host: tuple[int, int, int] = (2, 2, 1)
    device_name: str = ""
    memory_bandwidth: int = 0


TOPOLOGIES = {
    "tpu-v4-8": Topology("tpu", "v4:2x2x1", 4, 32 * GIB, chip_config="megacore"),
    "tpu-v5e-8": Topology("tpu", "v5e:2x4", 8, 16 * GIB, chips_per_host=(2, 4, 1)),
    "tpu-v5p-8": Topology("tpu", "v5:2x2x1", 4, 95 * GIB, chip_config="megacore"),
    "tpu-v6e-8": Topology("tpu", "v6e:2x4", 8, 32 * GIB, chips_per_host=(2, 4, 1)),
    "h100x8": Topology(
        "cuda", "1x1x8", 8, 80 * GIB, device_name="NVIDIA H100 80GB HBM3", memory_bandwidth=3_352_320_000_000
    ),
    # 143,771 MiB as nvidia-smi reports an H200 SXM; 4.8 TB/s by the datasheet.
    "h200x8": Topology(
        "cuda", "1x1x8", 8, 143771 * 2**20, device_name="NVIDIA H200", memory_bandwidth=4_800_000_000_000
    ),
}


def has_compiler(platform: str) -> bool:
    """Whether the compiler library of `platform` ('tpu' or 'cuda') is installed."""
    if platform == "tpu":
        return bool(os.environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None
    return importlib.util.find_spec("jax_plugins") is not None and any(
        importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13)
    )


def install_hint(platform: str) -> str:
    """The pip command that brings this JAX version's compiler for `platform`."""
    extra = "tpu" if platform == "tpu" else "cuda12-local"
    return f"pip install 'jax[{extra}]=={jax.__version__}'"


def gpu_target_config(topology: Topology) -> str:
    """A text-format `xla.GpuTargetConfigProto` of one Hopper GPU (132 SMs, compute capability 9.0)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {topology.memory_bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {topology.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{topology.device_name}"
"""


def get(name: str) -> Topology:
    """The named topology; a `ValueError` listing the names otherwise."""
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def compile_devices(name: str) -> list[jax.Device]:
    """Compile-only devices of the named topology (`TopologyUnavailable` where this host cannot compile
    for it)."""
    topology = get(name)
    try:
        if topology.platform == "tpu":
            description = topologies.get_topology_desc(
                platform="tpu",
                topology_name=topology.name,
                chip_config_name=topology.chip_config,
                chips_per_host_bounds=topology.chips_per_host,
                num_slices=1,
                wrap=(False, False, False),
            )
        else:
            description = topologies.get_topology_desc(
                platform="cuda", topology=topology.name, target_config=gpu_target_config(topology)
            )
    except (RuntimeError, NotImplementedError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fix = "" if has_compiler(topology.platform) else f"; {install_hint(topology.platform)}"
        raise TopologyUnavailable(f"cannot compile for {name} on this host ({reason}){fix}") from None
    devices = list(description.devices)
    if len(devices) != topology.num_devices:
        raise TopologyUnavailable(
            f"{name} ({topology.name}) gave {len(devices)} devices, expected {topology.num_devices}"
        )
    return devices
