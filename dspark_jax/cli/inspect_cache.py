"""Inspect a target cache (dspark_jax or DeepSpec v2 format).

    python -m dspark_jax.inspect_cache PATH [--verify] [--allow_incomplete]
                                            [--dump_sample=I --output=S.npz]

Prints a JSON summary (format, states, num_samples, num_tokens, aux_layer_ids, hidden_size,
dtypes, target, complete; for a DeepSpec v2 cache aux_layer_ids is its target_layer_ids and target
its target_model_name_or_path). ``states`` is false for a token-row cache (``data.features=online``:
input_ids and loss_mask only, no aux layers). ``--verify`` recomputes the checksums of a dspark_jax
cache; a DeepSpec v2 cache has none, so it checks the manifest and index and reads every sample,
printing one line per bad sample before exiting 1. Any error exits 1 with a message.
``--dump_sample`` writes sample I's input_ids, loss_mask and, from a cache of states, aux_hidden
[T, n_aux, H] and last_hidden [T, H] (hidden states as float32) to an .npz file.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.inspect_cache", description=__doc__.split("\n")[0])
    p.add_argument("path", help="cache directory (local or gs://)")
    p.add_argument("--verify", action="store_true", help="check all checksums (DeepSpec: read every sample)")
    p.add_argument("--allow_incomplete", action="store_true", help="verify/dump committed samples only")
    p.add_argument("--dump_sample", type=int, default=None, help="index of a sample to dump")
    p.add_argument("--output", default=None, help=".npz file for --dump_sample")
    args = p.parse_args(argv)
    if args.dump_sample is not None and not args.output:
        p.error("--dump_sample needs --output")
    try:
        summary = summarize(args.path, args.allow_incomplete)
        print(json.dumps(summary, indent=1))
        if args.verify:
            if summary["format"] == "deepspec":
                n, problems = deepspec.scan_deepspec(args.path)
                for msg in problems:
                    print(f"error: cache {args.path!r}: {msg}", file=sys.stderr)
                if problems:
                    print(f"verify: FAILED ({len(problems)} of {n} samples corrupt)", file=sys.stderr)
                    return 1
            else:
                n = cache.verify(args.path, allow_incomplete=args.allow_incomplete)
            print(f"verify: OK ({n} samples)")
        if args.dump_sample is not None:
            dump_sample(args.path, args.dump_sample, args.output, args.allow_incomplete)
            print(f"wrote sample {args.dump_sample} to {args.output}")
    except (ValueError, FileNotFoundError, IndexError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def launch() -> None:
    """The command: flags parsed, errors as one line (`cli.common.run`)."""
    sys.exit(main())


if __name__ == "__main__":
    launch()
