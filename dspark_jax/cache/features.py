"""Target features for the cache: aux layer outputs and the post-norm final state, in bf16.

Sequences are packed into rows of a power-of-two length (several whole samples a row, each attending to
itself only: `Transformer.__call__`'s packed positions), so a forward computes little padding; one jitted
forward per row shape returns `aux_hidden [B, T, A, H]` and `last_hidden [B, T, H]` already cast to
bfloat16 on device, so only the cache's bytes cross to the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

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


def state_features(state, tokens_BxT, positions_BxT, *, graphdef, aux_layer_ids):
    """The cache builder's program: `target_states` of packed rows, the model as `graphdef` + `state`
    (what it jits, and what `check_memory --program=target_forward` compiles)."""
    return target_states(
        nnx.merge(graphdef, state), tokens_BxT, aux_layer_ids=aux_layer_ids, positions_BxT=positions_BxT
    )


class Forward(NamedTuple):
    """One forward of the cache builder: `rows` packed rows of `width` tokens, `members[r]` the indices of
    the sequences in row `r`, in order (rows past `len(members)` are padding)."""

    width: int
    rows: int
    members: list[list[int]]


class FeatureExtractor:
    """Computes cache features for token sequences with a frozen target.

    Args:
      model: the target.
      aux_layer_ids: layers whose outputs form `aux_hidden` (-1 = embedding output).
      tokens_per_batch: tokens per forward; rows of length T run `max(1, tokens_per_batch // T)` at a
        time (`batches`).
      mesh: device mesh; batches are sharded over its data axes.
      rules: the sharding rules the target was placed by (`sharding.tracing`).
    """

    def __init__(
        self,
        model: Transformer,
        aux_layer_ids: Sequence[int],
        *,
        tokens_per_batch: int = 8192,
        mesh: Mesh | None = None,
        rules: sharding.Rules = sharding.DEFAULT_RULES,
    ):
        for layer_id in aux_layer_ids:
            model.cfg.layer_index(layer_id)
        self.graphdef, self.state = nnx.split(model)
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.tokens_per_batch = tokens_per_batch
        self.mesh = mesh or sharding.make_mesh()
        self.rules = rules
        self._forward = jax.jit(
            functools.partial(state_features, graphdef=self.graphdef, aux_layer_ids=self.aux_layer_ids)
        )

    def batches(self, sequences: Sequence[np.ndarray]) -> Iterator[Forward]:
        """The forwards of `sequences`, packed: longest first, each into the first row with room, rows of
        `R = prompt_bucket(longest)` tokens (a sample never splits), `tokens_per_batch // R` rows a forward,
        the last forward's rows rounded up to a quarter of that (at most four program shapes per `R`)."""
        width = prompt_bucket(max(len(ids) for ids in sequences))
        rows: list[list[int]] = []  # sequence indices per row
        room: list[int] = []
        for index in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
            n = len(sequences[index])
            row = next((r for r, free in enumerate(room) if free >= n), len(rows))
            if row == len(rows):
                rows.append([])
                room.append(width)
            rows[row].append(index)
            room[row] -= n
        per_forward = max(1, self.tokens_per_batch // width)
        step = max(1, per_forward // 4)
        for start in range(0, len(rows), per_forward):
            members = rows[start : start + per_forward]
            yield Forward(width, -(-len(members) // step) * step, members)

    def __call__(
        self, sequences: Sequence[np.ndarray], on_batch: Callable[[int, int], None] | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`(aux_hidden bf16[T, A, H], last_hidden bf16[T, H])` per sequence, in input order.

        Each forward runs packed rows (`target_states` with `positions_BxT`: every sample's states are its
        forward alone); `on_batch(sequences, tokens)` is called after each forward with what it covered.
        """
        if not sequences:
            return []
        results: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(sequences)
        for forward in self.batches(sequences):
            tokens = np.zeros((forward.rows, forward.width), np.int32)
            positions = np.tile(np.arange(forward.width, dtype=np.int32), (forward.rows, 1))
            spans = []  # (index, row, start, length)
            for row, members in enumerate(forward.members):
                start = 0
                for index in members:
                    n = len(sequences[index])
                    tokens[row, start : start + n] = sequences[index]
                    positions[row, start:] = np.arange(forward.width - start, dtype=np.int32)
                    spans.append((index, row, start, n))
                    start += n
            with sharding.tracing(self.mesh, self.rules):
                aux, last = self._forward(
                    self.state,
                    sharding.shard_batch(tokens, self.mesh, self.rules),
                    sharding.shard_batch(positions, self.mesh, self.rules),
                )
            aux, last = np.asarray(aux), np.asarray(last)
            for index, row, start, n in spans:
                results[index] = (aux[row, start : start + n], last[row, start : start + n])
            if on_batch is not None:
                on_batch(len(spans), sum(n for *_, n in spans))
        return results
