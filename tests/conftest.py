"""Test-wide setup: 8 fake CPU devices and one compilation cache (set before JAX initialises), shared
fixtures."""

import os

from tests import compilation_cache
from tests.worker_crash import pytest_handlecrashitem, pytest_report_teststatus  # noqa: F401 (hooks)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# glibc writes a heap-corruption abort's message to /dev/tty unless told otherwise: keep it in the log.
os.environ.setdefault("LIBC_FATAL_STDERR_", "1")
os.environ.update({name: os.environ.get(name, value) for name, value in compilation_cache.ENV.items()})

import jax
import pytest

from dspark_jax import sharding


@pytest.fixture(scope="session")
def mesh1():
    """A one-device mesh for tests that are about numbers, not sharding."""
    return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})


@pytest.fixture(scope="session")
def mesh8():
    """data=2 x fsdp=2 x tensor=2 over the 8 fake CPU devices."""
    assert len(jax.devices()) == 8
    return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


# Every compiled XLA CPU executable holds memory mappings; a long-lived xdist worker that compiles a few
# thousand programs (eager op-by-op forwards of the hybrid targets add ~3,000 maps a test) passes Linux's
# `vm.max_map_count` (65,530) and LLVM aborts the worker mid-test ("Fatal Python error: Aborted"). Past a
# threshold the worker drops JAX's compiled programs (the persistent cache reloads the costly ones).
MAX_MAPS = 30_000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


def pytest_runtest_teardown(item):
    if _memory_maps() > MAX_MAPS:
        jax.clear_caches()
