"""Cache build tokens/s and read samples/s on the demo target, next to the training step it feeds.

  python benchmarks/cache_throughput.py [--samples=64] [--length=512] [--preset=demo]

Build: SmolLM2 (the demo target) runs over `--samples` synthetic token sequences and the
features are written to a fresh cache in a temporary directory (tokens/s, including
tensorstore writes and checksums). Read: the grain pipeline over that cache produces
training batches of the preset's shape (samples/s), compared in the same run with the
demo training step's samples/s (synthetic batch, `benchmarks/train_step.py`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.train_step import time_step
from configs import baseline
from dspark_jax import sharding
from dspark_jax.cache import CacheDataSource
from dspark_jax.cache.build import TokenizedSamples, build_cache, cache_spec
from dspark_jax.data.pipeline import PipelineConfig, make_iterator
from dspark_jax.target import load_target


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--preset", default="demo")
    args = parser.parse_args()
    config = baseline.get_config(args.preset)
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = load_target(mesh=mesh)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.length // 2, args.length + 1, args.samples)
    ids = [rng.integers(100, target.config.vocab_size, n).astype(np.int32) for n in lengths]
    masks = [np.r_[np.zeros(n // 4, np.uint8), np.ones(n - n // 4, np.uint8)] for n in lengths]
    samples = TokenizedSamples(ids, masks, skipped=0, truncated=0)
    spec = cache_spec(target, config.data.aux_layer_ids, num_shards=2)

    with tempfile.TemporaryDirectory() as tmp:
        begin = time.perf_counter()
        build_cache(f"{tmp}/cache", target, samples, spec, mesh=mesh, progress=False)
        build_seconds = time.perf_counter() - begin
        source = CacheDataSource(f"{tmp}/cache")
        rows = config.train.global_batch
        pipe = PipelineConfig(
            max_length=config.data.max_length,
            num_anchors=config.train.num_anchors,
            batch_size=rows,
            seed=0,
            pad_id=0,
            num_epochs=None,
        )
        iterator = make_iterator(source, pipe)
        next(iterator)
        batches = max(4, 4 * args.samples // rows)
        begin = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        read_rate = batches * rows / (time.perf_counter() - begin)

    train_rate = time_step(baseline, args.preset, steps=2)["samples_per_second"]
    tokens = int(lengths.sum())
    print(
        f"demo target {target.config.family} H={target.config.hidden_size}, aux {config.data.aux_layer_ids}, "
        f"{args.samples} samples / {tokens} tokens"
    )
    print(f"build: {tokens / build_seconds:10.0f} tokens/s ({build_seconds:.1f} s)")
    print(
        f"read:  {read_rate:10.1f} samples/s (batches of {rows} x {config.data.max_length} tokens, "
        f"{config.train.num_anchors} anchors)"
    )
    print(
        f"train: {train_rate:10.2f} samples/s ({args.preset} step): read/train {read_rate / train_rate:.0f}x"
    )


if __name__ == "__main__":
    main()
