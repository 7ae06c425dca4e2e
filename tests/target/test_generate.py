"""Generation: greedy equals a naive full-recompute loop, padding/batching invariance, sampling, sharding."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import sharding
from dspark_jax.target import generate
from dspark_jax.target.config import TargetConfig
from dspark_jax.target.generate import Generator, SamplingParams, prompt_bucket, sampling_logits
from dspark_jax.target.model import Transformer

CFG = TargetConfig(
    family="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    max_position_embeddings=128,
    eos_token_ids=(3,),
)
EOS = 3


def _model(mesh, seed=0):
    model = Transformer(CFG, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    # Larger weights than the default init so greedy paths are varied rather than constant.
    state = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, state)
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))


def _naive_greedy(model, prompt, max_new):
    """Reference: recompute the whole (right-padded, causal) sequence each step; no cache."""
    forward = jax.jit(lambda ids: model.logits(model(ids).hidden_BxTxH))
    seq = list(prompt)
    out = []
    for _ in range(max_new):
        padded = np.zeros((1, 64), np.int32)
        padded[0, : len(seq)] = seq
        token = int(jnp.argmax(forward(jnp.asarray(padded))[0, len(seq) - 1]))
        if token == EOS:
            break
        out.append(token)
        seq.append(token)
    return out


PROMPTS = [[5, 9, 11], [7] * 17, [20, 21, 22, 23, 24, 25, 26, 27], [1, 2]]


@pytest.fixture(scope="module")
def model(mesh1):
    return _model(mesh1)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_greedy_matches_naive_loop(model, mesh1, padding):
    gen = Generator(model, eos_ids=[EOS], pad_id=0, batch_size=3, padding=padding, mesh=mesh1)
    got = gen.generate(PROMPTS, max_new_tokens=12)
    assert got == [_naive_greedy(model, p, 12) for p in PROMPTS]
    assert gen.stats.generated_tokens == sum(len(g) for g in got)


def test_sampling_is_seeded_and_batch_independent_of_padding(model, mesh1):
    params = SamplingParams(temperature=1.0, top_p=0.9)
    gen = Generator(model, eos_ids=[EOS], pad_id=0, batch_size=4, mesh=mesh1)
    a = gen.generate(PROMPTS, max_new_tokens=10, params=params, seed=7)
    b = gen.generate(PROMPTS, max_new_tokens=10, params=params, seed=7)
    c = gen.generate(PROMPTS, max_new_tokens=10, params=params, seed=8)
    assert a == b
    assert a != c


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]], np.float32))
    out = np.asarray(sampling_logits(jnp.asarray(logits), SamplingParams(temperature=1.0, top_p=0.7)))
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the two most likely tokens stay.
    np.testing.assert_array_equal(np.isfinite(out), [[1, 1, 0, 0], [0, 0, 1, 1]])
    empirical = np.bincount(
        np.asarray(jax.random.categorical(jax.random.key(0), jnp.asarray(out[0]), shape=(20000,))),
        minlength=4,
    )
    np.testing.assert_allclose(empirical / 20000, [0.625, 0.375, 0, 0], atol=0.015)


def test_sharded_generation_equals_single_device(model, mesh1, mesh8):
    sharded = _model(mesh8)
    kernel = sharded.layers[0].mlp.gate.kernel.get_value()
    assert len(kernel.sharding.device_set) == 8 and not kernel.sharding.is_fully_replicated
    single = Generator(model, eos_ids=[EOS], pad_id=0, batch_size=4, mesh=mesh1).generate(
        PROMPTS, max_new_tokens=12
    )
    multi = Generator(sharded, eos_ids=[EOS], pad_id=0, batch_size=4, mesh=mesh8).generate(
        PROMPTS, max_new_tokens=12
    )
    assert multi == single


def test_bad_requests_raise(model, mesh1):
    gen = Generator(model, eos_ids=[EOS], pad_id=0, mesh=mesh1)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen.generate([[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        gen.generate([[1] * 100], max_new_tokens=40)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_prompt_bucket():
    assert [prompt_bucket(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]


def test_length_sorted_batches_and_decode_segments_change_no_output(model, mesh1):
    """Batching shortest first and returning to the host every few decode steps (progress) leave every
    greedy reply as the unsorted single-program decode gives it, in request order."""
    prompts = [[5] * 30, [9, 11], [7] * 17, [20, 21, 22], [1, 2, 4, 8, 16], [12] * 9]
    reference = Generator(
        model, eos_ids=[EOS], pad_id=0, batch_size=2, mesh=mesh1, sort_by_length=False, decode_steps=64
    ).generate(prompts, max_new_tokens=20)
    calls = []
    gen = Generator(model, eos_ids=[EOS], pad_id=0, batch_size=2, mesh=mesh1, decode_steps=3)
    got = gen.generate(prompts, max_new_tokens=20, on_progress=lambda done, new: calls.append((done, new)))
    assert got == reference
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == len(prompts) and len(calls) > len(prompts)
    assert sum(new for _, new in calls) >= sum(map(len, got))  # EOS tokens count as produced


def test_generation_seconds_leave_out_the_compiles(model, mesh1, monkeypatch):
    """`stats.seconds` is run time only: a decode program compiled on a batch's first call (after its
    prefill ran) is not counted. Tracing each program moves the clock by 100 s, a compile no run takes."""
    offset, clock = [0.0], time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + offset[0])
    for name in ("_prefill_program", "_decode_program"):
        program = getattr(generate, name)

        def slow_to_trace(*args, program=program, **kwargs):
            offset[0] += 100.0
            return program(*args, **kwargs)

        monkeypatch.setattr(generate, name, slow_to_trace)
    gen = Generator(model, eos_ids=[EOS], pad_id=0, batch_size=2, mesh=mesh1)
    gen.generate(PROMPTS, max_new_tokens=6)
    assert gen.stats.compile_seconds >= 400  # two buckets, a prefill and a decode program each
    assert 0 < gen.stats.seconds < 100
