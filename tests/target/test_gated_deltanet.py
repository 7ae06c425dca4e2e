"""Gated DeltaNet against transformers' torch references: the chunked and recurrent delta rules, the causal
conv and the whole Qwen 3.5 layer, packed rows of several samples against each sample alone; and the
layer's ways through a sequence (whole, continued from a state token by token or by blocks, blocks kept to
a per-row prefix, right padding) equal to each other."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.target.gated_deltanet import (
    GatedDeltaNet,
    LinearState,
    causal_conv,
    chunked_delta_rule,
    keep_steps,
    prepare_qk,
    recurrent_delta_rule,
)
from tests.references import reference

torch = reference("torch")
transformers = reference("transformers")
qwen3_next = reference("transformers.models.qwen3_next.modeling_qwen3_next")
qwen3_5 = reference("transformers.models.qwen3_5.modeling_qwen3_5")

B, T, G, J, D, Y = 2, 41, 2, 4, 8, 6
TOL = dict(rtol=1e-5, atol=1e-5)
LAYER = dict(hidden=32, key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_kernel=4)


# The rules jitted: each shape compiles once for the whole file.
_chunked = jax.jit(chunked_delta_rule, static_argnames="chunk")
# Packed rows of T = 41 tokens (chunks of 16): samples that start inside a chunk, on a chunk boundary (32,
# 16), one of one token, one spanning two chunk boundaries.
SAMPLE_LENGTHS = [(10, 22, 9), (16, 1, 24)]


def _sample_ids():
    return np.stack([np.repeat(np.arange(len(lengths)), lengths) for lengths in SAMPLE_LENGTHS])


def _segments(row):
    """(start, end) of each sample of packed row `row`."""
    ends = np.cumsum(SAMPLE_LENGTHS[row])
    return list(zip(ends - np.asarray(SAMPLE_LENGTHS[row]), ends))


_recurrent = jax.jit(recurrent_delta_rule, static_argnames="all_states")


def _inputs(t, seed=0):
    """Raw q/k on `G` key heads, v/g/beta on `J` value heads, and an initial state."""
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, B, t, G, D)).astype(np.float32)
    v = rng.normal(size=(B, t, J, Y)).astype(np.float32)
    g = -np.abs(rng.normal(size=(B, t, J))).astype(np.float32) * 0.3
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, J))))).astype(np.float32)
    state = rng.normal(size=(B, J, D, Y)).astype(np.float32)
    return q, k, v, g, beta, state


def _ours(q, k, v, g, beta, state=None):
    """Our rules' arguments: q and k prepared and expanded to the value heads (`repeat_interleave`)."""
    q, k = prepare_qk(jnp.repeat(jnp.asarray(q), J // G, 2), jnp.repeat(jnp.asarray(k), J // G, 2))
    v, g, beta = (jnp.asarray(x) for x in (v, g, beta))
    return q, k, v, g, beta, None if state is None else jnp.asarray(state)


def _torch(fn, q, k, v, g, beta, state, **kw):
    """transformers' rule on q and k expanded to the value heads as its layer expands them
    (`repeat_interleave`: older 5.x rules take no grouped heads; the head mapping is the layer test's)."""
    q, k = (np.repeat(x, J // G, 2) for x in (q, k))
    out, final = fn(
        *(torch.tensor(x) for x in (q, k, v)),
        g=torch.tensor(g),
        beta=torch.tensor(beta),
        initial_state=None if state is None else torch.tensor(state),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **kw,
    )
    return out.numpy(), final.numpy()


@pytest.mark.parametrize("with_state", [False, True])
def test_both_rules_equal_the_torch_references_with_grouped_heads(with_state):
    """T = 41: two whole chunks of 16 and a partial one."""
    q, k, v, g, beta, state = _inputs(T)
    state = state if with_state else None
    args = _ours(q, k, v, g, beta, state)
    ref_out, ref_state = _torch(
        qwen3_next.torch_chunk_gated_delta_rule, q, k, v, g, beta, state, chunk_size=16
    )
    out, final = _chunked(*args, chunk=16)
    np.testing.assert_allclose(np.asarray(out), ref_out, **TOL)
    np.testing.assert_allclose(np.asarray(final), ref_state, **TOL)
    ref_out, ref_state = _torch(qwen3_next.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    out, final = _recurrent(*args)
    np.testing.assert_allclose(np.asarray(out), ref_out, **TOL)
    np.testing.assert_allclose(np.asarray(final), ref_state, **TOL)


def test_chunked_equals_recurrent_whose_last_step_state_is_the_final_state():
    args = _ours(*_inputs(T, seed=3))
    out, final = _chunked(*args, chunk=16)
    step_out, states = _recurrent(*args, all_states=True)
    _, step_final = _recurrent(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(step_out), **TOL)
    np.testing.assert_allclose(np.asarray(final), np.asarray(step_final), **TOL)
    np.testing.assert_array_equal(np.asarray(states[:, -1]), np.asarray(step_final))


def test_chunked_continued_from_its_state_equals_the_whole_sequence():
    q, k, v, g, beta, state = _ours(*_inputs(T, seed=1))
    whole, final = _chunked(q, k, v, g, beta, state, chunk=16)
    first, mid = _chunked(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], state, chunk=16)
    second, end = _chunked(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], mid, chunk=16)
    np.testing.assert_allclose(np.concatenate([first, second], 1), whole, **TOL)
    np.testing.assert_allclose(end, final, **TOL)


def test_packed_rows_restart_the_chunked_rule_where_each_sample_starts():
    """Each sample of a packed row against the torch chunked rule on that sample alone: the first from the
    initial state, later ones from zero; the final state is the last sample's."""
    q, k, v, g, beta, state = _inputs(T, seed=5)
    out, final = _chunked(*_ours(q, k, v, g, beta, state), chunk=16, sample_BxT=jnp.asarray(_sample_ids()))
    for row in range(B):
        for n, (start, end) in enumerate(_segments(row)):
            piece = [x[row : row + 1, start:end] for x in (q, k, v, g, beta)]
            first = state[row : row + 1] if n == 0 else None
            ref_out, ref_state = _torch(qwen3_next.torch_chunk_gated_delta_rule, *piece, first, chunk_size=16)
            got = np.asarray(out[row, start:end])
            np.testing.assert_allclose(got, ref_out[0], **TOL, err_msg=f"row {row} sample {n}")
        np.testing.assert_allclose(np.asarray(final[row]), ref_state[0], **TOL)


def test_causal_conv_of_a_packed_row_equals_each_sample_alone():
    x = np.random.default_rng(6).normal(size=(B, T, 3, 5)).astype(np.float32)
    taps = jnp.asarray(np.random.default_rng(7).normal(size=(4, 3, 5)).astype(np.float32))
    y, _ = causal_conv(jnp.asarray(x), taps, sample_BxT=jnp.asarray(_sample_ids()))
    for row in range(B):
        for start, end in _segments(row):
            alone, _ = causal_conv(jnp.asarray(x[row : row + 1, start:end]), taps)
            np.testing.assert_allclose(np.asarray(y[row, start:end]), alone[0], rtol=1e-6, atol=1e-6)


def test_causal_conv_equals_torch_conv1d_and_continues_from_its_window():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, 11, 3, 5)).astype(np.float32)
    taps = rng.normal(size=(4, 3, 5)).astype(np.float32)
    channels = torch.tensor(x.reshape(B, 11, 15).transpose(0, 2, 1))
    weight = torch.tensor(taps.reshape(4, 15).T[:, None, :])
    ref = torch.nn.functional.silu(
        torch.nn.functional.conv1d(channels, weight, padding=3, groups=15)[..., :11]
    )
    ref = ref.numpy().transpose(0, 2, 1).reshape(B, 11, 3, 5)
    y, _ = causal_conv(jnp.asarray(x), jnp.asarray(taps))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-6)
    head, window = causal_conv(jnp.asarray(x[:, :6]), jnp.asarray(taps))
    assert window.shape == (B, 3 + 6, 3, 5)
    tail, _ = causal_conv(jnp.asarray(x[:, 6:]), jnp.asarray(taps), window[:, 6:9])
    np.testing.assert_allclose(np.concatenate([head, tail], 1), ref, rtol=1e-5, atol=1e-6)


@functools.cache
def _layers():
    """A random Qwen 3.5 Gated DeltaNet layer (every parameter drawn, the norm weight included) and ours
    holding the same weights, copied here from the torch layout: `in_proj_qkv` rows and the depthwise conv's
    channels are `[q (G*D); k (G*D); v (J*Y)]`, conv1d weight `[C, 1, K]`."""
    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=LAYER["hidden"],
        linear_num_key_heads=LAYER["key_heads"],
        linear_num_value_heads=LAYER["value_heads"],
        linear_key_head_dim=LAYER["key_dim"],
        linear_value_head_dim=LAYER["value_dim"],
        linear_conv_kernel_dim=LAYER["conv_kernel"],
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    hf = qwen3_5.Qwen3_5GatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if name in ("A_log", "dt_bias", "norm.weight") else 0.2)
        hf.norm.weight.add_(1.0)
    w = {name: p.detach().numpy() for name, p in hf.named_parameters()}
    # Ours built abstractly (shapes only, no random init to compile); every parameter is set below.
    ours = nnx.eval_shape(lambda: GatedDeltaNet(**LAYER, eps=1e-6, rngs=nnx.Rngs(0)))
    h, g, d = LAYER["hidden"], LAYER["key_heads"], LAYER["key_dim"]
    j, y, k = LAYER["value_heads"], LAYER["value_dim"], LAYER["conv_kernel"]
    q_rows, k_rows, v_rows = np.split(w["in_proj_qkv.weight"], [g * d, 2 * g * d])
    q_taps, k_taps, v_taps = np.split(w["conv1d.weight"][:, 0, :].T, [g * d, 2 * g * d], axis=1)
    values = [
        (ours.q.kernel, q_rows.T.reshape(h, g, d)),
        (ours.k.kernel, k_rows.T.reshape(h, g, d)),
        (ours.v.kernel, v_rows.T.reshape(h, j, y)),
        (ours.z.kernel, w["in_proj_z.weight"].T.reshape(h, j, y)),
        (ours.b.kernel, w["in_proj_b.weight"].T),
        (ours.a.kernel, w["in_proj_a.weight"].T),
        (ours.q_taps, q_taps.reshape(k, g, d)),
        (ours.k_taps, k_taps.reshape(k, g, d)),
        (ours.v_taps, v_taps.reshape(k, j, y)),
        (ours.dt_bias, w["dt_bias"]),
        (ours.a_log, w["A_log"]),
        (ours.norm_scale, w["norm.weight"]),
        (ours.out.kernel, w["out_proj.weight"].T.reshape(j, y, h)),
    ]
    for param, value in values:
        assert param.get_value().shape == value.shape
        param.set_value(jnp.asarray(value))
    params = jax.tree.leaves(nnx.state(ours, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(isinstance(p.get_value(), jax.Array) for p in params), "a parameter was left unset"
    return hf, ours


# The layer tests share one batch of rows and a few shapes (whole: 21 tokens, continued: 1 or 6, kept
# steps: 5), each compiled once, to keep the file fast.
ROWS, WHOLE = 4, 21
_whole = nnx.jit(lambda layer, x, valid: layer(x, valid))
_continue = nnx.jit(lambda layer, x, valid, state: layer(x, valid, state=state))
_all_states = nnx.jit(lambda layer, x, state: layer(x, state=state, all_states=True))


def _x(t):
    return jnp.asarray(np.random.default_rng(4).normal(size=(ROWS, t, LAYER["hidden"])).astype(np.float32))


def _zero_state():
    keys = ("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel")
    return LinearState.zeros(ROWS, **{name: LAYER[name] for name in keys}, dtype=jnp.float32)


def _token_by_token(layer, x, state):
    """Outputs `[B, T, H]` and the state after each of the tokens, one `T = 1` step at a time."""
    outs, states = [], []
    for i in range(x.shape[1]):
        y, state = _continue(layer, x[:, i : i + 1], jnp.ones((ROWS, 1), bool), state)
        outs.append(y)
        states.append(state)
    return jnp.concatenate(outs, 1), states


def _row(state, row):
    return jax.tree.map(lambda a: a[row], state)


def _assert_states_equal(got, want, **where):
    for name, a, b in zip(LinearState._fields, got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL, err_msg=f"{name} {where}")


def test_layer_equals_qwen3_5_gated_deltanet_with_left_padding():
    hf, ours = _layers()
    x = _x(WHOLE)
    mask = np.ones((ROWS, WHOLE), bool)
    mask[1, :6] = mask[3, :20] = False
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(x)), attention_mask=torch.tensor(mask.astype(np.int64))).numpy()
    got, _ = _whole(ours, x, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), ref, **TOL)


def test_layer_continued_token_by_token_and_by_all_states_blocks_equals_the_whole_sequence():
    _, ours = _layers()
    x = _x(WHOLE)
    whole, final = _whole(ours, x, jnp.ones((ROWS, WHOLE), bool))
    got, states = _token_by_token(ours, x, _zero_state())
    np.testing.assert_allclose(got, whole, **TOL)
    _assert_states_equal(states[-1], final)
    got, state = _continue(ours, x[:, :6], jnp.ones((ROWS, 6), bool), _zero_state())  # a chunked prefill
    got = [got]
    for start in (6, 11, 16):  # then blocks that keep every step
        y, steps = _all_states(ours, x[:, start : start + 5], state)
        state = keep_steps(state, steps, jnp.full((ROWS,), 5))
        got.append(y)
    np.testing.assert_allclose(np.concatenate(got, 1), whole, **TOL)
    _assert_states_equal(state, final)


def test_keep_steps_per_row_equals_running_only_the_kept_tokens():
    """A block of 5 kept to 0, 2 and all 5 tokens, and to 1 (fewer than the conv window's K-1 = 3)."""
    _, ours = _layers()
    keep = [0, 2, 5, 1]
    x = _x(11)
    _, before = _continue(ours, x[:, :6], jnp.ones((ROWS, 6), bool), _zero_state())
    _, steps = _all_states(ours, x[:, 6:], before)
    kept = keep_steps(before, steps, jnp.asarray(keep))
    _, after = _token_by_token(ours, x[:, 6:], before)
    for row, n in enumerate(keep):
        want = before if n == 0 else after[n - 1]
        _assert_states_equal(_row(kept, row), _row(want, row), row=row, keep=n)


def test_right_padding_leaves_the_state_after_the_last_real_token():
    """From a state, rows with 6, 4, 0 and 1 real tokens of 6: the padding neither decays the recurrent
    state nor shifts the conv windows."""
    _, ours = _layers()
    real = [6, 4, 0, 1]
    x = _x(12)
    _, before = _continue(ours, x[:, :6], jnp.ones((ROWS, 6), bool), _zero_state())
    valid = jnp.arange(6)[None, :] < jnp.asarray(real)[:, None]
    y, padded = _continue(ours, x[:, 6:], valid, before)
    want_y, after = _token_by_token(ours, x[:, 6:], before)
    for row, n in enumerate(real):
        np.testing.assert_allclose(np.asarray(y[row, :n]), np.asarray(want_y[row, :n]), **TOL)
        want = before if n == 0 else after[n - 1]
        _assert_states_equal(_row(padded, row), _row(want, row), row=row, real=n)
