"""What a cache of either format (dspark_jax's, DeepSpec v2's) holds: a summary, a check of every sample,
one sample as arrays."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from dspark_jax import cache
from dspark_jax.cache import format as fmt
from dspark_jax.cache.reader import committed_counts
from dspark_jax.interop import deepspec_cache as deepspec
from dspark_jax.run.sources import open_cache


def summarize(path: str, allow_incomplete: bool = False) -> dict[str, Any]:
    """JSON-able summary of the cache at ``path``."""
    m = fmt.read_json(fmt.open_kvstore(path), fmt.MANIFEST)
    if m is None:
        raise FileNotFoundError(f"no {fmt.MANIFEST} in cache directory {path!r}")
    if deepspec.is_deepspec(m):
        ds = deepspec.DeepSpecDataSource(path)
        n_aux, h = ds.num_aux, ds.hidden_size
        return {
            "format": "deepspec",
            "states": True,
            "num_samples": len(ds),
            "num_tokens": int(ds.index["seq_len"].sum()),
            "num_shards": len(ds.shard_files),
            "aux_layer_ids": ds.aux_layer_ids,
            "num_aux_layers": n_aux,
            "hidden_size": h,
            "dtypes": {
                "input_ids": "int32",
                "loss_mask": "uint8",
                "aux_hidden": "bfloat16",
                "last_hidden": "bfloat16",
            },
            "target": ds.manifest["target_model_name_or_path"],
            "complete": True,
        }
    m = fmt.read_manifest(path)
    counts = committed_counts(path, m, allow_incomplete=True)
    spec = m["spec"]
    return {
        "format": fmt.FORMAT_NAME,
        "format_version": m["format_version"],
        "states": spec.get("states", True),  # manifests before `CacheSpec.states` hold states
        "num_samples": m["num_samples"],
        "num_tokens": m["num_tokens"],
        "committed_samples": sum(c[0] for c in counts),
        "committed_tokens": sum(c[1] for c in counts),
        "num_shards": spec["num_shards"],
        "aux_layer_ids": spec["aux_layer_ids"],
        "hidden_size": spec["hidden_size"],
        "dtypes": m["dtypes"],
        "target": spec["target"],
        "tokenizer_fingerprint": spec["tokenizer_fingerprint"],
        "complete": m["complete"],
    }


def dump_sample(path: str, index: int, output: str, allow_incomplete: bool = False) -> None:
    """Write sample ``index`` to ``output`` (.npz; local path or gs:// through tensorstore)."""
    sample = open_cache(path, allow_incomplete=allow_incomplete)[index]
    arrays = {k: (v.astype(np.float32) if v.dtype == fmt.BF16 else v) for k, v in sample.items()}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    parent, _, name = output.rstrip("/").rpartition("/")
    fmt.open_kvstore(parent or ".").write(name, buf.getvalue()).result()


def verify(path: str, allow_incomplete: bool = False) -> tuple[int, list[str]]:
    """`(samples checked, one message per bad sample)`: a dspark_jax cache's checksums recomputed (damage
    raises `cache.CacheCorruptError` naming every bad shard), a DeepSpec v2 cache (no checksums) read
    sample by sample."""
    manifest = fmt.read_json(fmt.open_kvstore(path), fmt.MANIFEST)
    if manifest is not None and deepspec.is_deepspec(manifest):
        return deepspec.scan_deepspec(path)
    return cache.verify(path, allow_incomplete=allow_incomplete), []
