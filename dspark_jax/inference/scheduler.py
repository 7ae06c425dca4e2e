"""The hardware-aware prefix scheduler (DSpark, section 3.2, Algorithm 1) and its throughput table.

Each cycle, request `r` (`B` rows, `S` proposals; shape letters: the legend in `dspark_jax/__init__.py`)
has prefix survival probabilities `a_{r,j} = prod_{i<=j} c_{r,i}` from the calibrated confidence head:
the chance that its first `j` proposals are all accepted. Verifying `l_r` of them costs `1 + l_r` tokens
(the pending token is always fed) and yields `1 + sum_{j<=l_r} a_{r,j}` tokens in expectation. With
`SPS(n)` the verification forward passes per second at `n` tokens in total, Algorithm 1 starts from
`l_r = 0`, takes the candidates `(r, j)` in decreasing `a_{r,j}` and admits each while the expected
throughput `tau* x SPS(n)` strictly rises (`tau*` the expected tokens, `n` the tokens verified), stopping
at the first candidate that does not raise it. Candidates of one request come in order `j = 1, 2, ..`
(`a` is non-increasing in `j`; ties keep that order), so each request's admitted set is a prefix. The
choice reads only the draft's own confidences, never the target's verdicts: decisions are
non-anticipating, which keeps decoding lossless (the paper's Appendix A).

The engine verifies a padded `[B, W]` batch, `W` the smallest of `buckets` that holds every chosen
`1 + l_r`; one compiled branch per bucket, so no length combination recompiles. `SPS` is profiled once
per decoder on the real verification program at the bucket widths (`n = B x W` tokens) and
interpolated linearly in `n` between them (flat beyond); rows padded past their `1 + l_r` cost compute
the table attributes to the whole padded batch, a gap to a ragged (paged) serving engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.target.model import DecodeCache, Transformer

DEFAULT_BUCKETS = (1, 2, 4, 8)


def default_buckets(proposals: int) -> tuple[int, ...]:
    """`DEFAULT_BUCKETS` below `proposals + 1`, then `proposals + 1` (every proposal verified)."""
    return (*(w for w in DEFAULT_BUCKETS if w <= proposals), proposals + 1)


def check_buckets(buckets: Sequence[int], proposals: int) -> tuple[int, ...]:
    """Verification widths: increasing, from 1, the last one `proposals + 1` (every proposal verified)."""
    buckets = tuple(int(w) for w in buckets)
    increasing = list(buckets) == sorted(set(buckets))
    if not buckets or buckets[0] != 1 or buckets[-1] != proposals + 1 or not increasing:
        raise ValueError(
            f"verify buckets must increase from 1 to the proposals per cycle + 1 = {proposals + 1}, "
            f"got {list(buckets)}"
        )
    return buckets


def schedule_lengths(survival_BxS: jax.Array, active_B: jax.Array, sps_N: jax.Array) -> jax.Array:
    """Algorithm 1: proposals to verify per row, int32 `[B]` in `0..S` (0 for inactive rows).

    `survival_BxS` are `a_{r,j}` (non-increasing along a row), `sps_N` the throughput table indexed by the
    verified token count `n` (length at least `B * (S + 1) + 1`; index 0 unused).
    """
    b, s = survival_BxS.shape
    a_C = jnp.where(active_B[:, None], survival_BxS.astype(jnp.float32), -1.0).reshape(-1)  # C = B x S
    order_C = jnp.argsort(-a_C, stable=True)  # row-major ties: a row's candidates stay in order
    sorted_C = a_C[order_C]
    real_C = sorted_C >= 0  # active rows' candidates, all ahead of the inactive ones
    base = jnp.sum(active_B).astype(jnp.float32)
    tau_C1 = base + jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.where(real_C, sorted_C, 0.0))])
    tokens_C1 = base.astype(jnp.int32) + jnp.arange(b * s + 1)
    throughput_C1 = tau_C1 * sps_N[tokens_C1]
    rises_C = real_C & (throughput_C1[1:] > throughput_C1[:-1])
    admitted_C = jnp.cumprod(rises_C.astype(jnp.int32))  # stop at the first candidate that does not raise
    return jnp.zeros((b,), jnp.int32).at[order_C // s].add(admitted_C)


def bucket_index(lengths_B: jax.Array, active_B: jax.Array, buckets: Sequence[int]) -> jax.Array:
    """Index of the smallest bucket width that holds `1 + l_r` for every active row (0 when none is)."""
    widest = jnp.max(jnp.where(active_B, lengths_B + 1, 1))
    return jnp.searchsorted(jnp.asarray(buckets), widest).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SpsTable:
    """Measured verification passes per second at `tokens[i]` tokens per pass (`rows` x width)."""

    rows: int
    max_len: int
    tokens: tuple[int, ...]
    sps: tuple[float, ...]

    def dense(self, max_tokens: int) -> np.ndarray:
        """f32[max_tokens + 1]: `SPS(n)` for every `n`, linear between the measured points, flat beyond."""
        n = np.arange(max_tokens + 1)
        return np.interp(n, self.tokens, self.sps).astype(np.float32)

    def as_dict(self) -> dict:
        return {
            "rows": self.rows,
            "cache_slots": self.max_len,
            "tokens": list(self.tokens),
            "sps": list(self.sps),
        }


def profile_sps(
    target: Transformer,
    *,
    rows: int,
    max_len: int,
    buckets: Sequence[int],
    aux_layer_ids: Sequence[int],
    repeats: int = 5,
) -> SpsTable:
    """Times the verification forward (target with its decoding cache, the linear layers' per-token states,
    LM head) at `[rows, W]` per bucket width.

    The cache has `max_len` slots, half of them filled (attention reads the whole buffer either way); each
    width compiles once, then the median of `repeats` timed calls gives `SPS = 1 / seconds`.
    """
    graphdef, state = nnx.split(target)
    aux_layer_ids = tuple(aux_layer_ids)

    @jax.jit
    def verify(state, tokens_BxW, cache):
        model = nnx.merge(graphdef, state)
        out = model(tokens_BxW, cache=cache, aux_layer_ids=aux_layer_ids, keep_steps=True)
        return model.logits(out.hidden_BxTxH), out.aux_BxTxAxH, out.steps

    cache = DecodeCache.zeros(target.cfg, rows, max_len, target.dtype)
    cache = cache._replace(end_B=jnp.full((rows,), max_len // 2, jnp.int32))
    tokens, sps = [], []
    for width in buckets:
        tokens_BxW = jnp.ones((rows, width), jnp.int32)
        jax.block_until_ready(verify(state, tokens_BxW, cache))  # compile
        seconds = []
        for _ in range(repeats):
            begin = time.perf_counter()
            jax.block_until_ready(verify(state, tokens_BxW, cache))
            seconds.append(time.perf_counter() - begin)
        tokens.append(rows * width)
        sps.append(1.0 / float(np.median(seconds)))
    return SpsTable(rows, max_len, tuple(tokens), tuple(sps))
