"""A local stand-in for `gs://` in `etils.epath` (tests): `gs://bucket/key` is `<root>/bucket/key`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from etils.epath import testing


@contextlib.contextmanager
def fake_gcs(root: str | os.PathLike) -> Iterator[None]:
    root = os.fspath(root)

    def local(path):
        path = os.fspath(path)
        return os.path.join(root, path[len("gs://") :]) if path.startswith("gs://") else path

    def one(original, path, *args, **kwargs):
        return original(local(path), *args, **kwargs)

    def two(original, path, dst, *args, **kwargs):
        return original(local(path), local(dst), *args, **kwargs)

    def open_(original, path, mode):
        path = local(path)
        if any(c in mode for c in "wax"):  # an object store has no directories to create first
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return original(path, mode)

    single = ("exists", "isdir", "listdir", "glob", "makedirs", "mkdir", "remove", "rmtree", "stat", "walk")
    with testing.mock_epath(
        open=open_, **dict.fromkeys(single, one), **dict.fromkeys(("copy", "rename", "replace"), two)
    ):
        yield
