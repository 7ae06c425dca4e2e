"""The cache builder's target forward: packed rows (several whole samples a row) vs one length bucket per
forward (one sample a row, the builder before 2026-12-05), tokens/s and padding, in one run.

  python benchmarks/cache_forward.py [--cache=PATH] [--samples=256] [--commit=64]

Sample lengths come from a built cache (`--cache`: its first `--samples` samples, e.g. the demo's train
cache) or, without one, the demo's measured spread (uniform 150-350 tokens). Both schemes run the
SmolLM2 demo target over the same sequences, `--commit` samples a call (as the builder commits them),
after one untimed pass that compiles their shapes; their outputs are compared (bf16 steps).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import baseline
from dspark_jax import sharding
from dspark_jax.cache import CacheDataSource
from dspark_jax.cache.features import FeatureExtractor, Forward
from dspark_jax.target import load_target
from dspark_jax.target.generate import prompt_bucket


class PerBucket(FeatureExtractor):
    """The baseline: one sample a row, one power-of-two length bucket a forward, `tokens_per_batch // T`
    rows each (the last forward of a bucket padded to them)."""

    def batches(self, sequences):
        by_bucket: dict[int, list[int]] = {}
        for index, ids in enumerate(sequences):
            by_bucket.setdefault(prompt_bucket(len(ids)), []).append(index)
        for width in sorted(by_bucket, reverse=True):
            rows, members = max(1, self.tokens_per_batch // width), by_bucket[width]
            for start in range(0, len(members), rows):
                yield Forward(width, rows, [[i] for i in members[start : start + rows]])


def run(extractor: FeatureExtractor, sequences, commit: int) -> tuple[float, int, list]:
    """Seconds, computed tokens and features of `sequences` in calls of `commit` samples."""
    computed, out = 0, []
    begin = time.perf_counter()
    for start in range(0, len(sequences), commit):
        part = sequences[start : start + commit]
        computed += sum(f.width * f.rows for f in extractor.batches(part))
        out += extractor(part)
    return time.perf_counter() - begin, computed, out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", default="")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--commit", type=int, default=64)
    args = parser.parse_args()
    config = baseline.get_config("demo")
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = load_target(mesh=mesh)
    rng = np.random.default_rng(0)
    if args.cache:
        lengths = CacheDataSource(args.cache, read_states=False).lengths()[: args.samples]
    else:
        lengths = rng.integers(150, 351, args.samples)
    sequences = [rng.integers(100, target.config.vocab_size, n).astype(np.int32) for n in lengths]
    real = int(sum(lengths))
    print(
        f"SmolLM2 target, {len(sequences)} samples ({real} tokens, "
        f"{'lengths of ' + args.cache if args.cache else 'uniform 150-350'}), {args.commit} a call"
    )
    results = {}
    for name, cls in (("per bucket (baseline)", PerBucket), ("packed", FeatureExtractor)):
        extractor = cls(target.model, config.data.aux_layer_ids, mesh=mesh)
        run(extractor, sequences, args.commit)  # compiles every shape
        seconds, computed, out = run(extractor, sequences, args.commit)
        results[name] = out
        print(
            f"{name:>22s}: {seconds:7.1f} s, {real / seconds:6.0f} tokens/s, computed {computed} tokens "
            f"({computed / real:.2f}x the real ones)"
        )
    (a, b) = results.values()
    steps = [
        np.abs(x.astype(np.float32) - y.astype(np.float32)).max()
        for fa, fb in zip(a, b)
        for x, y in zip(fa, fb)
    ]
    print(f"largest difference between the two schemes' features: {max(steps):.3g}")


if __name__ == "__main__":
    main()
