"""Inspect a target cache (dspark_jax or DeepSpec v2 format).

    python -m dspark_jax.inspect_cache PATH [--verify] [--allow_incomplete]
                                            [--dump_sample=I --output=S.npz]

Prints a JSON summary (format, states, num_samples, num_tokens, aux_layer_ids, hidden_size,
dtypes, target, complete; for a DeepSpec v2 cache aux_layer_ids is its target_layer_ids and target
its target_model_name_or_path). ``states`` is false for a token-row cache (``data.features=online``:
input_ids and loss_mask only, no aux layers). ``--verify`` recomputes the checksums of a dspark_jax
cache; a DeepSpec v2 cache has none, so it checks the manifest and index and reads every sample,
printing one line per bad sample before exiting 1. Any error exits 1 with one `error:` line.
``--dump_sample`` writes sample I's input_ids, loss_mask and, from a cache of states, aux_hidden
[T, n_aux, H] and last_hidden [T, H] (hidden states as float32) to an .npz file.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from dspark_jax.cli import check_flags, define_path_flag, run
from dspark_jax.errors import UsageError
from dspark_jax.run import cache_info

_VERIFY = flags.DEFINE_bool("verify", False, "Check every sample (checksums; DeepSpec: read every sample).")
_ALLOW_INCOMPLETE = flags.DEFINE_bool("allow_incomplete", False, "Verify or dump committed samples only.")
_DUMP_SAMPLE = flags.DEFINE_integer("dump_sample", None, "Index of a sample to write to --output.")
_OUTPUT = define_path_flag("output", None, ".npz file for --dump_sample (local path or gs://).")


def inspect(
    path: str,
    *,
    verify: bool = False,
    allow_incomplete: bool = False,
    dump_sample: int | None = None,
    output: str | None = None,
) -> int:
    """Prints the cache's summary, then what `verify` and `dump_sample` ask for; the exit status (1 when a
    DeepSpec cache holds bad samples, which are printed one a line)."""
    summary = cache_info.summarize(path, allow_incomplete)
    print(json.dumps(summary, indent=1))
    if verify:
        n, problems = cache_info.verify(path, allow_incomplete)
        for message in problems:
            print(f"error: cache {path!r}: {message}", file=sys.stderr)
        if problems:
            print(f"verify: FAILED ({len(problems)} of {n} samples corrupt)", file=sys.stderr)
            return 1
        print(f"verify: OK ({n} samples)")
    if dump_sample is not None:
        cache_info.dump_sample(path, dump_sample, output, allow_incomplete)
        print(f"wrote sample {dump_sample} to {output}")
    return 0


def main(argv):
    paths = argv[1:]
    if len(paths) != 1:
        raise UsageError(f"give one cache directory: python -m dspark_jax.inspect_cache PATH, got {paths}")
    wants_output = _DUMP_SAMPLE.value is None or bool(_OUTPUT.value)
    check_flags(output=(wants_output, "must name the .npz of --dump_sample"))
    return inspect(
        paths[0],
        verify=_VERIFY.value,
        allow_incomplete=_ALLOW_INCOMPLETE.value,
        dump_sample=_DUMP_SAMPLE.value,
        output=_OUTPUT.value,
    )


if __name__ == "__main__":
    run(main, config_default=None)
