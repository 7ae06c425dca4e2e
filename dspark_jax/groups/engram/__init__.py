"""Engram n-gram memory: hashing (`hashing`), tables on disk and on device (`table`), fitting (`fit`)."""

from dspark_jax.groups.engram.hashing import (
    HashSpec,
    compression_map,
    device_hashes,
    host_hashes,
    normalize_key,
)
from dspark_jax.groups.engram.table import (
    EngramTable,
    HostTable,
    TableError,
    device_table,
    load_table,
    save_table,
)

__all__ = [
    "EngramTable",
    "HashSpec",
    "HostTable",
    "TableError",
    "compression_map",
    "device_hashes",
    "device_table",
    "host_hashes",
    "load_table",
    "normalize_key",
    "save_table",
]
