"""Engram lookup cost per speculative cycle: on device (as the engine does it) next to host NumPy.

  python benchmarks/engram_lookup.py [--config=configs/engram_markov.py] [--table=PATH] [--rows=1,8,64]

Per row count: milliseconds of one jitted device lookup (the last `N` tokens of each request hashed
with uint32 limbs, rows gathered from the table: Engram-MASK's one lookup per cycle), of the `S`
chained lookups of Engram-Markov's selection loop (each window grows by one drafted token), and of the
same single lookup on the host (NumPy int64 hashing + gather, then the copy to the device). The table
is the config's fitted one (`--table`, default its default path) or, when none exists, a random one of
the config's demo shape (timing does not depend on the values).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_config_module
from dspark_jax.groups.engram import prepare
from dspark_jax.groups.engram.group import PrefixWindow
from dspark_jax.groups.engram.hashing import host_hashes
from dspark_jax.groups.engram.table import load_table


def _ms(fn, *args, repeats=50):
    jax.block_until_ready(fn(*args))
    begin = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return 1e3 * (time.perf_counter() - begin) / repeats


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/engram_markov.py")
    parser.add_argument("--table", default="", help="a fitted table; default: a random one of the demo shape")
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--slots", type=int, default=7)
    args = parser.parse_args()
    config = load_config_module(args.config).get_config("demo")
    if args.table:
        host = load_table(args.table)
        table, spec, compress = host.to_device(), host.spec, host.compress_V
    else:
        vocab = config.target.arch.vocab_size
        table = prepare.synthetic_table(config, vocab)
        spec = prepare.synthetic_spec(config, vocab)
        compress = np.arange(vocab)
    rows_xW = np.asarray(table.rows_xW)
    n = spec.max_order
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}; "
        f"table {spec.num_rows} rows x {spec.head_dim}, U = {spec.dim}"
    )
    print(f"{'rows':>5s} {'device 1 lookup ms':>19s} {'device S chained ms':>20s} {'host 1 lookup ms':>17s}")

    @jax.jit
    def one(tokens_BxN, end_B):
        return PrefixWindow(table, tokens_BxN, end_B).features()

    @jax.jit
    def chained(tokens_BxN, end_B, drafts_BxS):
        window = PrefixWindow(table, tokens_BxN, end_B)
        return jnp.stack([window.push(drafts_BxS[:, i]) for i in range(drafts_BxS.shape[1])], 1)

    def host_lookup(tokens_BxN, end_B):
        positions = end_B[:, None] - n + np.arange(n)
        ids = host_hashes(spec, compress[tokens_BxN], positions)[:, -1] + spec.offsets
        return jax.device_put(rows_xW[ids].reshape(len(tokens_BxN), spec.dim))

    rng = np.random.default_rng(0)
    for b in (int(r) for r in args.rows.split(",")):
        tokens = rng.integers(0, len(compress), (b, n)).astype(np.int32)
        end = np.full((b,), 100, np.int32)
        drafts = rng.integers(0, len(compress), (b, args.slots)).astype(np.int32)
        device_one = _ms(one, jnp.asarray(tokens), jnp.asarray(end))
        device_chain = _ms(chained, jnp.asarray(tokens), jnp.asarray(end), jnp.asarray(drafts))
        host_one = _ms(host_lookup, tokens, end)
        print(f"{b:5d} {device_one:19.3f} {device_chain:20.3f} {host_one:17.3f}")


if __name__ == "__main__":
    main()
