"""One builder at a time: an exclusive lock around building a cache shard or regenerating replies.

A second process that asks for a lock another one holds logs who holds it and waits; when it gets
the lock, the build it wanted is usually done and it resumes with nothing to do. Locks are
`fcntl` locks on local files, released by the kernel when their process dies (a killed build never
leaves a stale lock). For a URL (`gs://...`) the lock file lives under the local lock directory,
so it guards builders on the same machine only; run multi-host builds with distinct
`--process_index` values.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def lock_file(target: str, name: str, lock_dir: str | os.PathLike) -> Path:
    """The lock file guarding `name` (e.g. 'train-p0of1') of the cache or file `target`."""
    digest = hashlib.sha256(target.encode()).hexdigest()[:16]
    return Path(lock_dir, f"{digest}-{name}.lock")


@contextlib.contextmanager
def exclusive(path: Path, what: str) -> Iterator[None]:
    """Holds the lock file `path` for the block; waits (with a message) while another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            log.warning("%s is being built by another process (pid %s); waiting for it", what, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
