"""One persistent XLA compilation cache for the whole test run, its subprocesses included.

Many tests compile the same programs (the SmolLM2 forward, a tiny preset's training step, a
subprocess's `python -m dspark_jax.train`); with the cache each is compiled once per run and loaded
after that. The executables are the same programs, so no result changes; JAX keys every entry by
its own version, the computation, the devices and the flags, so the 3.11 and 3.12 venvs can share
the directory. It lives in pytest's own cache folder (git-ignored) and is capped in size.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax_compilation_cache"

ENV = {
    "JAX_COMPILATION_CACHE_DIR": str(DIRECTORY),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),
}
