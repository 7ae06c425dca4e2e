"""A draft vocabulary for decoding: the tokens the draft may propose, ranked by how often the training
text uses them (frequency-ranked drafting, as FR-Spec and EAGLE-3's reduced draft vocabularies).

A selection then reads `K` of the LM head's `V` columns: on hardware where that pass is a large part of a
cycle (a CPU, or a target with a large vocabulary) the cycle shortens, and a proposal outside the `K`
tokens is simply never made (the target still decides what is emitted: lossless).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def most_frequent(counts_V: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The `size` token ids with the largest counts, ties to the lower id, plus every id of `always` (e.g.
    the EOS ids, so a draft can propose the end), ascending, int32."""
    counts_V = np.asarray(counts_V)
    if not 0 < size <= len(counts_V):
        raise ValueError(f"draft vocabulary size must be in 1..{len(counts_V)} (the vocabulary), got {size}")
    ranked = np.argsort(-counts_V, kind="stable")[:size]
    return np.union1d(ranked, np.asarray(always, np.int64)).astype(np.int32)


def coverage(counts_V: np.ndarray, ids_K: np.ndarray) -> float:
    """Share of the counted tokens that the vocabulary `ids_K` holds."""
    counts_V = np.asarray(counts_V, np.float64)
    return float(counts_V[ids_K].sum() / max(counts_V.sum(), 1.0))
