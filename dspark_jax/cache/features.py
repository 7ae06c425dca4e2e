"""Target features for the cache: aux layer outputs and the post-norm final state, in bf16.

Sequences are grouped into length buckets (powers of two) and right-padded; one jitted
forward per bucket shape returns `aux_hidden [B, T, A, H]` and `last_hidden [B, T, H]`
already cast to bfloat16 on device, so only the cache's bytes cross to the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax import sharding
from dspark_jax.target.generate import prompt_bucket
from dspark_jax.target.model import Transformer


def target_states(
    model: Transformer,
    tokens_BxT: jax.Array,
    *,
    aux_layer_ids: Sequence[int],
    valid_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    dtype=jnp.bfloat16,
) -> tuple[jax.Array, jax.Array]:
    """What a cache stores of token rows, `(aux_hidden [B, T, A, H], last_hidden [B, T, H])` in `dtype`:
    right-padded rows with `valid_BxT`, or packed ones with `positions_BxT` (`Transformer.__call__`). The
    cache builder and online training (`dspark_jax.training.online`) both run this forward."""
    out = model(
        tokens_BxT, valid_BxT=valid_BxT, positions_BxT=positions_BxT, aux_layer_ids=tuple(aux_layer_ids)
    )
    return out.aux_BxTxAxH.astype(dtype), out.hidden_BxTxH.astype(dtype)


def state_features(state, tokens_BxT, valid_BxT, *, graphdef, aux_layer_ids):
    """The cache builder's program: `target_states` of right-padded rows, the model as `graphdef` + `state`
    (what it jits, and what `check_memory --program=target_forward` compiles)."""
    return target_states(
        nnx.merge(graphdef, state), tokens_BxT, aux_layer_ids=aux_layer_ids, valid_BxT=valid_BxT
    )


class FeatureExtractor:
    """Computes cache features for token sequences with a frozen target.

    Args:
      model: the target.
      aux_layer_ids: layers whose outputs form `aux_hidden` (-1 = embedding output).
      tokens_per_batch: padded tokens per forward; a bucket of length T runs
        `max(1, tokens_per_batch // T)` rows.
      mesh: device mesh; batches are sharded over its data axes.
    """

    def __init__(
        self,
        model: Transformer,
        aux_layer_ids: Sequence[int],
        *,
        tokens_per_batch: int = 8192,
        mesh: Mesh | None = None,
    ):
        for layer_id in aux_layer_ids:
            model.cfg.layer_index(layer_id)
        self.graphdef, self.state = nnx.split(model)
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.tokens_per_batch = tokens_per_batch
        self.mesh = mesh or sharding.make_mesh()
        self._forward = jax.jit(
            functools.partial(state_features, graphdef=self.graphdef, aux_layer_ids=self.aux_layer_ids)
        )

    def batches(self, sequences: Sequence[np.ndarray]) -> Iterator[tuple[int, int, list[int]]]:
        """`(bucket length, rows, indices)` per forward: one length bucket each, longest first."""
        by_bucket: dict[int, list[int]] = {}
        for index, ids in enumerate(sequences):
            by_bucket.setdefault(prompt_bucket(len(ids)), []).append(index)
        for length in sorted(by_bucket, reverse=True):
            rows = max(1, self.tokens_per_batch // length)
            members = by_bucket[length]
            for start in range(0, len(members), rows):
                yield length, rows, members[start : start + rows]

    def __call__(
        self, sequences: Sequence[np.ndarray], on_batch: Callable[[int, int], None] | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`(aux_hidden bf16[T, A, H], last_hidden bf16[T, H])` per sequence, in input order.

        `on_batch(sequences, tokens)` is called after each forward with what it covered.
        """
        results: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(sequences)
        for length, rows, group in self.batches(sequences):
            tokens = np.zeros((rows, length), np.int32)
            valid = np.zeros((rows, length), bool)
            for row, index in enumerate(group):
                n = len(sequences[index])
                tokens[row, :n] = sequences[index]
                valid[row, :n] = True
            aux, last = self._forward(
                self.state, sharding.shard_batch(tokens, self.mesh), sharding.shard_batch(valid, self.mesh)
            )
            aux, last = np.asarray(aux), np.asarray(last)
            for row, index in enumerate(group):
                n = len(sequences[index])
                results[index] = (aux[row, :n], last[row, :n])
            if on_batch is not None:
                on_batch(len(group), sum(len(sequences[index]) for index in group))
        return results
