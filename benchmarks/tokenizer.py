"""Encode throughput of the project's byte-level BPE next to Hugging Face `tokenizers`, per target family.

  python benchmarks/tokenizer.py [--families=smollm2,qwen3,qwen3_5]

Each family's `tokenizer.json` is built as the identity test builds it (`tests/target/tokenizer_families.py`,
into a temporary directory; needs the test extras), and every encoder runs over that test's 3,000 ShareGPT
texts: the project's `Tokenizer.encode`, `tokenizers`' `encode` one text at a time (single-threaded, like
ours) and its `encode_batch` (threads on every core). Each is loaded fresh and timed over two passes: the
first starts with empty word caches, the second reuses them. Prints texts/s and tokens/s per pass, and
whether the ids are equal. About 40 s on two cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax.target.tokenizer import Tokenizer
from tests.target.tokenizer_families import FAMILIES, build, sharegpt_corpus

WIDTHS = (13, 8, 14, 9)


def _encoders(path: Path) -> dict[str, object]:
    """name -> function from the texts to their ids, each with a freshly loaded tokenizer."""
    mine = Tokenizer.from_tokenizer_json(path)
    single, batch = (tokenizers.Tokenizer.from_file(str(path)) for _ in range(2))
    return {
        "dspark Tokenizer.encode": lambda texts: [mine.encode(t) for t in texts],
        "tokenizers encode": lambda texts: [single.encode(t, add_special_tokens=False).ids for t in texts],
        "tokenizers encode_batch": lambda texts: [
            e.ids for e in batch.encode_batch(texts, add_special_tokens=False)
        ],
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    families = args.families.split(",")
    if unknown := sorted(set(families) - set(FAMILIES)):
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    corpus = sharegpt_corpus()
    texts = corpus.test
    print(f"{len(texts)} ShareGPT texts, {sum(map(len, texts)) / 1e6:.2f}M characters")
    header = ("texts/s cold", "warm", "tokens/s cold", "warm")
    print(f"{'family':9s} {'encoder':25s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, WIDTHS)))
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            path = build(family, Path(tmp) / family, corpus.train)
            reference = None
            for name, encode in _encoders(path).items():
                seconds = []
                for _ in range(2):
                    begin = time.perf_counter()
                    ids = encode(texts)
                    seconds.append(time.perf_counter() - begin)
                reference = reference or ids
                tokens = sum(map(len, ids))
                rates = [len(texts) / s for s in seconds] + [tokens / s for s in seconds]
                same = "" if ids == reference else "  (ids differ from the first encoder's)"
                print(
                    f"{family:9s} {name:25s} " + " ".join(f"{r:{w}.0f}" for r, w in zip(rates, WIDTHS)) + same
                )


if __name__ == "__main__":
    main()
