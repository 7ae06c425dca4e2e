"""Gated DeltaNet: the linear-attention layer of the hybrid targets (Qwen3-Next, Qwen 3.5).

Per value head `j` the layer keeps a state `S [D, Y]` (key dim x value dim). For each token, after a
depthwise causal conv + SiLU over q/k/v, l2-normalised q and k (q also scaled by `D^-1/2`), a log
decay `g = -exp(A_log) * softplus(a + dt_bias)` and a write strength `beta = sigmoid(b)`:

  S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

and the output is `out(RMSNorm(o) * w * silu(z))`. Value head `j` reads key head `j // E` (`E = J/G`).
Two forms compute the same recurrence: `chunked_delta_rule` (whole sequences: a scan over chunks, the
within-chunk part by a unit-triangular solve) and `recurrent_delta_rule` (a scan over tokens that can keep
the state after every token, which speculative verification needs to keep exactly the accepted prefix).
A packed row (several samples, `sample_BxT` numbering them) runs through the chunked form and the conv with
the state and the conv window reset where a sample starts, so that each sample's outputs equal its forward
alone. Shape letters follow the legend in `dspark_jax/__init__.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.nn import Dtype, Linear, normal_init, rms_norm

_HIGHEST = jax.lax.Precision.HIGHEST
_L2_EPS = 1e-6


def prepare_qk(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q and k l2-normalised over their last axis (`x * rsqrt(sum x^2 + 1e-6)`, float32), q scaled by
    `D^-1/2`."""
    norm = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)
    q, k = norm(q.astype(jnp.float32)), norm(k.astype(jnp.float32))
    return q * q.shape[-1] ** -0.5, k


def chunked_delta_rule(
    q_BxTxJxD: jax.Array,
    k_BxTxJxD: jax.Array,
    v_BxTxJxY: jax.Array,
    g_BxTxJ: jax.Array,
    beta_BxTxJ: jax.Array,
    state_BxJxDxY: jax.Array | None = None,
    *,
    chunk: int = 64,
    sample_BxT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence over whole sequences, `chunk` tokens at a time: outputs `[B, T, J, Y]` and the final
    state `[B, J, D, Y]` (float32). The `N` chunks of `S = chunk` slots go through a scan; within a chunk
    the writes come from one unit-lower-triangular solve (the WY / UT form). Padding to a chunk multiple
    uses `g = beta = 0`: the state passes through it unchanged.

    `sample_BxT` (non-decreasing per row: a packed row's sample numbers) restarts the recurrence from a zero
    state where the number changes: a slot reads and is decayed with only the writes of its own sample, and
    the state a chunk passes on holds only its last sample's writes (plus the incoming state if that
    sample began before the chunk)."""
    b, t, j, d = q_BxTxJxD.shape
    y = v_BxTxJxY.shape[-1]
    pad = -t % chunk
    n = (t + pad) // chunk

    def chunks(x_BxTxJx):  # [B, T, J, ...] -> [N, B, J, S, ...]: chunks first, for the scan
        x = jnp.pad(x_BxTxJx.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x_BxTxJx.ndim - 2))
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    q_NxBxJxSxD, k_NxBxJxSxD, v_NxBxJxSxY = chunks(q_BxTxJxD), chunks(k_BxTxJxD), chunks(v_BxTxJxY)
    g_NxBxJxS, beta_NxBxJxS = chunks(g_BxTxJ), chunks(beta_BxTxJ)
    cum_NxBxJxS = jnp.cumsum(g_NxBxJxS, axis=-1)  # log decay from the chunk's start through slot s
    lower_SxS = jnp.tril(jnp.ones((chunk, chunk), bool))
    # seen[i, s]: slot i reads slot s's write (s <= i, the same sample); carry[s]: slot s continues the
    # sequence of the state the chunk starts from (always, unpacked).
    seen_NxBxJxSxS, carry_NxBxJxS = lower_SxS, jnp.ones((n, b, 1, chunk), bool)
    if sample_BxT is not None:
        sample_NxBxS = jnp.pad(sample_BxT, [(0, 0), (0, pad)], mode="edge").reshape(b, n, chunk)
        sample_NxBxS = sample_NxBxS.swapaxes(0, 1)
        before_NxBx1 = jnp.concatenate([sample_NxBxS[:1, :, :1], sample_NxBxS[:-1, :, -1:]], axis=0)
        carry_NxBxJxS = (sample_NxBxS == before_NxBx1)[:, :, None]
        same_NxBxJxSxS = (sample_NxBxS[..., :, None] == sample_NxBxS[..., None, :])[:, :, None]
        seen_NxBxJxSxS = lower_SxS & same_NxBxJxSxS
    # decay[i, s] = exp(cum_i - cum_s) where i sees s: what slot s's write has decayed to at slot i.
    gap_NxBxJxSxS = cum_NxBxJxS[..., :, None] - cum_NxBxJxS[..., None, :]
    decay_NxBxJxSxS = jnp.where(seen_NxBxJxSxS, jnp.exp(jnp.where(seen_NxBxJxSxS, gap_NxBxJxSxS, 0.0)), 0.0)
    dot = lambda a, c: jnp.einsum("...id,...sd->...is", a, c, precision=_HIGHEST)
    k_beta_NxBxJxSxD = k_NxBxJxSxD * beta_NxBxJxS[..., None]
    # Slot i writes u_i - w_i S0 (S0 the state at the chunk's start), where [u, w] solve
    # (I + strictly_lower(beta k k^T * decay)) [u, w] = [beta v, beta k exp(cum)].
    strict_SxS = jnp.tril(lower_SxS, -1)
    system_NxBxJxSxS = jnp.where(strict_SxS, dot(k_beta_NxBxJxSxD, k_NxBxJxSxD) * decay_NxBxJxSxS, 0.0)
    # exp(cum) where the slot reads the incoming state, else 0 (a sample that starts inside the chunk).
    from_start_NxBxJxS = jnp.where(carry_NxBxJxS, jnp.exp(cum_NxBxJxS), 0.0)
    rhs_NxBxJxSxYD = jnp.concatenate(
        [v_NxBxJxSxY * beta_NxBxJxS[..., None], k_beta_NxBxJxSxD * from_start_NxBxJxS[..., None]], axis=-1
    )
    solved_NxBxJxSxYD = jax.lax.linalg.triangular_solve(
        system_NxBxJxSxS, rhs_NxBxJxSxYD, left_side=True, lower=True, unit_diagonal=True
    )
    u_NxBxJxSxY, w_NxBxJxSxD = solved_NxBxJxSxYD[..., :y], solved_NxBxJxSxYD[..., y:]
    attend_NxBxJxSxS = dot(q_NxBxJxSxD, k_NxBxJxSxD) * decay_NxBxJxSxS
    q_decayed_NxBxJxSxD = q_NxBxJxSxD * from_start_NxBxJxS[..., None]
    # What each slot's write has decayed to at the chunk's last slot (0 from an earlier sample).
    k_decayed_NxBxJxSxD = k_NxBxJxSxD * decay_NxBxJxSxS[..., -1, :, None]
    chunk_decay_NxBxJx1x1 = from_start_NxBxJxS[..., -1:, None]

    def step(state_BxJxDxY, xs):
        u_BxJxSxY, w_BxJxSxD, attend_BxJxSxS, q_decayed_BxJxSxD, k_decayed_BxJxSxD, chunk_decay_BxJx1x1 = xs
        writes_BxJxSxY = u_BxJxSxY - jnp.einsum(
            "bjsd,bjdy->bjsy", w_BxJxSxD, state_BxJxDxY, precision=_HIGHEST
        )
        out_BxJxSxY = jnp.einsum("bjsd,bjdy->bjsy", q_decayed_BxJxSxD, state_BxJxDxY, precision=_HIGHEST)
        out_BxJxSxY += jnp.einsum("bjis,bjsy->bjiy", attend_BxJxSxS, writes_BxJxSxY, precision=_HIGHEST)
        state_BxJxDxY = state_BxJxDxY * chunk_decay_BxJx1x1 + jnp.einsum(
            "bjsd,bjsy->bjdy", k_decayed_BxJxSxD, writes_BxJxSxY, precision=_HIGHEST
        )
        return state_BxJxDxY, out_BxJxSxY

    state_BxJxDxY = _initial_state(state_BxJxDxY, b, j, d, y)
    xs = (
        u_NxBxJxSxY,
        w_NxBxJxSxD,
        attend_NxBxJxSxS,
        q_decayed_NxBxJxSxD,
        k_decayed_NxBxJxSxD,
        chunk_decay_NxBxJx1x1,
    )
    state_BxJxDxY, out_NxBxJxSxY = jax.lax.scan(step, state_BxJxDxY, xs)
    out_BxTxJxY = jnp.moveaxis(out_NxBxJxSxY, 0, 1).transpose(0, 1, 3, 2, 4).reshape(b, n * chunk, j, y)
    return out_BxTxJxY[:, :t], state_BxJxDxY


def _initial_state(state_BxJxDxY: jax.Array | None, b: int, j: int, d: int, y: int) -> jax.Array:
    """The recurrent state to start from, in float32 (zeros when None)."""
    if state_BxJxDxY is None:
        return jnp.zeros((b, j, d, y), jnp.float32)
    return state_BxJxDxY.astype(jnp.float32)


def recurrent_delta_rule(
    q_BxTxJxD: jax.Array,
    k_BxTxJxD: jax.Array,
    v_BxTxJxY: jax.Array,
    g_BxTxJ: jax.Array,
    beta_BxTxJ: jax.Array,
    state_BxJxDxY: jax.Array | None = None,
    *,
    all_states: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence one token at a time: outputs `[B, T, J, Y]` and the final state `[B, J, D, Y]`, or
    with `all_states` the state after every token, `[B, T, J, D, Y]` (float32)."""
    b, _, j, d = q_BxTxJxD.shape
    time_first = lambda x_BxTx: jnp.moveaxis(x_BxTx.astype(jnp.float32), 1, 0)

    def step(state_BxJxDxY, xs):
        q_BxJxD, k_BxJxD, v_BxJxY, g_BxJ, beta_BxJ = xs
        state_BxJxDxY = state_BxJxDxY * jnp.exp(g_BxJ)[..., None, None]
        read_BxJxY = jnp.einsum("bjdy,bjd->bjy", state_BxJxDxY, k_BxJxD, precision=_HIGHEST)
        delta_BxJxY = (v_BxJxY - read_BxJxY) * beta_BxJ[..., None]
        state_BxJxDxY = state_BxJxDxY + k_BxJxD[..., :, None] * delta_BxJxY[..., None, :]
        out_BxJxY = jnp.einsum("bjdy,bjd->bjy", state_BxJxDxY, q_BxJxD, precision=_HIGHEST)
        return state_BxJxDxY, (out_BxJxY, state_BxJxDxY if all_states else None)

    state_BxJxDxY = _initial_state(state_BxJxDxY, b, j, d, v_BxTxJxY.shape[-1])
    xs = tuple(time_first(x) for x in (q_BxTxJxD, k_BxTxJxD, v_BxTxJxY, g_BxTxJ, beta_BxTxJ))
    state_BxJxDxY, (out_TxBxJxY, states_TxBxJxDxY) = jax.lax.scan(step, state_BxJxDxY, xs)
    out_BxTxJxY = jnp.moveaxis(out_TxBxJxY, 0, 1)
    return (out_BxTxJxY, jnp.moveaxis(states_TxBxJxDxY, 0, 1)) if all_states else (out_BxTxJxY, state_BxJxDxY)


def causal_conv(
    x: jax.Array, taps: jax.Array, history: jax.Array | None = None, sample_BxT: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv over time + SiLU: `x [B, T, ...]`, `taps [K, ...]` (one filter per channel),
    `history [B, K-1, ...]` the previous inputs (zeros when None). Accumulates in float32 and returns
    `(y [B, T, ...], window)` in `x.dtype`, with `window = [history; x]` `[B, K-1+T, ...]`: the conv state
    after the first `n` new tokens is `window[:, n : n + K - 1]`. With `sample_BxT` (a packed row's sample
    numbers; no history) a tap reads zero where its input belongs to an earlier sample."""
    k, t = taps.shape[0], x.shape[1]
    if history is None:
        history = jnp.zeros((x.shape[0], k - 1, *x.shape[2:]), x.dtype)
    window = jnp.concatenate([history.astype(x.dtype), x], axis=1)
    taps32, window32 = taps.astype(jnp.float32), window.astype(jnp.float32)
    inputs = [window32[:, i : i + t] for i in range(k)]  # what tap i reads at each position
    if sample_BxT is not None:  # the window's sample numbers, -1 for the (zero) history
        owner_BxT = jnp.pad(sample_BxT, [(0, 0), (k - 1, 0)], constant_values=-1)
        channels = (1,) * (x.ndim - 2)
        same = lambda i: (owner_BxT[:, i : i + t] == sample_BxT).reshape(*sample_BxT.shape, *channels)
        inputs = [jnp.where(same(i), tap_input, 0.0) for i, tap_input in enumerate(inputs)]
    y = sum(tap_input * taps32[i] for i, tap_input in enumerate(inputs))
    return jax.nn.silu(y).astype(x.dtype), window


class LinearState(NamedTuple):
    """One linear-attention layer's decoding state: the last `K-1` pre-conv inputs of q, k and v (`T =
    K-1`) and the recurrent state (float32)."""

    q_BxTxGxD: jax.Array
    k_BxTxGxD: jax.Array
    v_BxTxJxY: jax.Array
    s_BxJxDxY: jax.Array

    @classmethod
    def zeros(
        cls,
        batch: int,
        *,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        dtype: Dtype,
    ) -> LinearState:
        window = (batch, conv_kernel - 1)
        return cls(
            jnp.zeros((*window, key_heads, key_dim), dtype),
            jnp.zeros((*window, key_heads, key_dim), dtype),
            jnp.zeros((*window, value_heads, value_dim), dtype),
            jnp.zeros((batch, value_heads, key_dim, value_dim), jnp.float32),
        )


class LinearSteps(NamedTuple):
    """A linear-attention layer's states after each of `T` new tokens: the conv windows `[history; new]`
    (`K-1+T` positions) and the recurrent state after every token."""

    q_BxTxGxD: jax.Array
    k_BxTxGxD: jax.Array
    v_BxTxJxY: jax.Array
    states_BxTxJxDxY: jax.Array

    def padded(self, tokens: int) -> LinearSteps:
        """The same steps padded (with zeros, never kept) to `tokens` new tokens."""
        extra = tokens - self.states_BxTxJxDxY.shape[1]
        pad = lambda x: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
        return LinearSteps(*(pad(x) for x in self))


def _windows_after(windows: tuple[jax.Array, ...], keep_B: jax.Array, width: int) -> tuple[jax.Array, ...]:
    """`window[b, keep[b] : keep[b] + width]` per row of each `[B, T, ...]` window: the conv states after
    the first `keep[b]` new tokens."""
    one = lambda window_BxTx: jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, width, axis=0))(
        window_BxTx, keep_B
    )
    return tuple(one(window) for window in windows)


def keep_steps(before: LinearState, steps: LinearSteps, keep_B: jax.Array) -> LinearState:
    """The state after the first `keep_B[b]` of the new tokens of row `b` (0 keeps `before`)."""
    width = before.q_BxTxGxD.shape[1]
    index_B = jnp.clip(keep_B - 1, 0, steps.states_BxTxJxDxY.shape[1] - 1)
    kept_BxJxDxY = steps.states_BxTxJxDxY[jnp.arange(keep_B.shape[0]), index_B]
    s_BxJxDxY = jnp.where((keep_B > 0)[:, None, None, None], kept_BxJxDxY, before.s_BxJxDxY)
    return LinearState(*_windows_after(steps[:3], keep_B, width), s_BxJxDxY)


class GatedDeltaNet(nnx.Module):
    """The Gated DeltaNet token mixer: projections, causal convs, the delta rule, gated norm, output."""

    def __init__(
        self,
        hidden: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        eps: float,
        *,
        rngs: nnx.Rngs,
        param_dtype: Dtype = jnp.float32,
        dtype: Dtype = jnp.float32,
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        g, j, d, y = key_heads, value_heads, key_dim, value_dim
        self.eps = eps
        self.dtype = dtype
        self.q = Linear((hidden,), (g, d), ("embed", "kv_heads", "head_dim"), **kw)
        self.k = Linear((hidden,), (g, d), ("embed", "kv_heads", "head_dim"), **kw)
        self.v = Linear((hidden,), (j, y), ("embed", "heads", "head_dim"), **kw)
        self.z = Linear((hidden,), (j, y), ("embed", "heads", "head_dim"), **kw)
        self.b = Linear((hidden,), (j,), ("embed", "heads"), **kw)
        self.a = Linear((hidden,), (j,), ("embed", "heads"), **kw)
        taps = lambda *shape: normal_init(rngs, (conv_kernel, *shape), param_dtype, std=0.5)
        self.q_taps = nnx.Param(taps(g, d), axes=(None, "kv_heads", "head_dim"))
        self.k_taps = nnx.Param(taps(g, d), axes=(None, "kv_heads", "head_dim"))
        self.v_taps = nnx.Param(taps(j, y), axes=(None, "heads", "head_dim"))
        self.dt_bias = nnx.Param(jnp.ones((j,), param_dtype), axes=("heads",))
        self.a_log = nnx.Param(jnp.zeros((j,), param_dtype), axes=("heads",))
        self.norm_scale = nnx.Param(jnp.ones((y,), param_dtype), axes=("norm",))
        self.out = Linear((j, y), (hidden,), ("heads", "head_dim", "embed"), **kw)

    def __call__(
        self,
        x_BxTxH: jax.Array,
        valid_BxT: jax.Array | None = None,
        state: LinearState | None = None,
        *,
        all_states: bool = False,
        chunk: int = 64,
        sample_BxT: jax.Array | None = None,
    ) -> tuple[jax.Array, LinearState | LinearSteps]:
        """The mixer over `T` tokens; `valid_BxT` marks real tokens (a contiguous run per row): the others
        read as zero input and leave the state unchanged. Without `state` the tokens start the sequence;
        with it they continue it. `sample_BxT` (without `state`) runs packed rows: each sample starts from
        a zero state and an empty conv window. Returns the output `[B, T, H]` and the state after the last
        real token, or with `all_states` the states after every token (`LinearSteps`)."""
        if sample_BxT is not None and (state is not None or all_states):
            raise ValueError("packed rows (sample_BxT) run a whole-sequence forward: no state, no all_states")
        b, t, _ = x_BxTxH.shape
        if valid_BxT is not None:
            x_BxTxH = jnp.where(valid_BxT[..., None], x_BxTxH, 0)
        history = (None, None, None) if state is None else state[:3]
        conv = lambda proj, taps, past: causal_conv(proj(x_BxTxH), taps.get_value(), past, sample_BxT)
        q_BxTxGxD, q_window_BxTxGxD = conv(self.q, self.q_taps, history[0])
        k_BxTxGxD, k_window_BxTxGxD = conv(self.k, self.k_taps, history[1])
        v_BxTxJxY, v_window_BxTxJxY = conv(self.v, self.v_taps, history[2])
        windows = (q_window_BxTxGxD, k_window_BxTxGxD, v_window_BxTxJxY)
        per_key = v_BxTxJxY.shape[2] // q_BxTxGxD.shape[2]
        q_BxTxJxD, k_BxTxJxD = prepare_qk(
            jnp.repeat(q_BxTxGxD, per_key, 2), jnp.repeat(k_BxTxGxD, per_key, 2)
        )
        beta_BxTxJ = jax.nn.sigmoid(self.b(x_BxTxH).astype(jnp.float32))
        a_BxTxJ = self.a(x_BxTxH).astype(jnp.float32) + self.dt_bias.get_value().astype(jnp.float32)
        g_BxTxJ = -jnp.exp(self.a_log.get_value().astype(jnp.float32)) * jax.nn.softplus(a_BxTxJ)
        if valid_BxT is not None:
            g_BxTxJ = jnp.where(valid_BxT[..., None], g_BxTxJ, 0.0)
            beta_BxTxJ = jnp.where(valid_BxT[..., None], beta_BxTxJ, 0.0)
        s_BxJxDxY = None if state is None else state.s_BxJxDxY
        rule = (q_BxTxJxD, k_BxTxJxD, v_BxTxJxY, g_BxTxJ, beta_BxTxJ, s_BxJxDxY)
        if all_states:
            o_BxTxJxY, states_BxTxJxDxY = recurrent_delta_rule(*rule, all_states=True)
            new_state = LinearSteps(*windows, states_BxTxJxDxY)
        else:  # a chunk no longer than the next power of two of T: one token decodes as a chunk of one
            o_BxTxJxY, s_BxJxDxY = chunked_delta_rule(
                *rule, chunk=min(chunk, 1 << (t - 1).bit_length()), sample_BxT=sample_BxT
            )
            end_B = jnp.full((b,), t, jnp.int32)
            if valid_BxT is not None:  # the windows after the last real token
                end_B = jnp.max(jnp.where(valid_BxT, jnp.arange(1, t + 1), 0), axis=1).astype(jnp.int32)
            new_state = LinearState(*_windows_after(windows, end_B, windows[0].shape[1] - t), s_BxJxDxY)
        # The gated norm as Qwen3NextRMSNormGated: normalise in float32, scale in the activation dtype,
        # gate by silu(z) in float32.
        o_BxTxJxY = o_BxTxJxY.astype(self.dtype)
        normed_BxTxJxY = rms_norm(o_BxTxJxY, self.eps) * self.norm_scale.get_value().astype(self.dtype)
        gate_BxTxJxY = jax.nn.silu(self.z(x_BxTxH).astype(jnp.float32))
        return self.out((normed_BxTxJxY.astype(jnp.float32) * gate_BxTxJxY).astype(self.dtype)), new_state
