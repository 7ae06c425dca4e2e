"""The platform a program is being compiled for, which picks a kernel's implementation."""

from __future__ import annotations

import jax


def target_backend() -> str:
    """The platform being compiled for: the current mesh's devices' (`jax.set_mesh`), else the default;
    'gpu' for CUDA (a topology's compile-only devices say 'cuda')."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    backend = device.platform if device is not None else jax.default_backend()
    return "gpu" if backend == "cuda" else backend
