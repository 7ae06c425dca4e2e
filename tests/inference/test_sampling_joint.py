"""Sampling losslessness of the whole engine, by the joint distribution of every token a first cycle can
emit (a three-token vocabulary: 3 ** 6 outcomes) and a test per position, for every proposer, the prefix
scheduler's per-row cap and a hybrid MoE target; and the power of those tests against planted rules."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.inference import engine, scheduler
from dspark_jax.target.generate import SamplingParams
from tests.inference.test_acceptance import (
    biased_at_position_3,
    chi_square_p,
    joint_cells,
    per_position_pvalues,
    residual_biased_from_position_3,
)
from tests.inference.test_speculate import (
    DRAFT,
    GROUPS,
    HYBRID_TARGET,
    TARGET,
    _decoder,
    _group,
    _parts,
    _scheduled,
)
from tests.marks import tiered

# The joint test: a three-token vocabulary, blocks of 4 proposals, an EOS id the target never samples.
V3, S3, ROWS3 = 3, 4, 24_000
TARGET3 = dataclasses.replace(TARGET, vocab_size=V3, eos_token_ids=(V3,))
DRAFT3 = dataclasses.replace(DRAFT, vocab_size=V3, block_size=S3)
PROMPT3 = [1, 2, 0, 1]
N3 = S3 + 2  # the prefill's token and every token the first cycle can emit: 3 ** 6 joint outcomes


@pytest.fixture(scope="module")
def parts3(mesh1):
    return _parts(TARGET3, DRAFT3, mesh1)


@pytest.fixture(scope="module")
def hybrid_parts3(mesh1):
    return _parts(dataclasses.replace(HYBRID_TARGET, vocab_size=V3, eos_token_ids=(V3,)), DRAFT3, mesh1)


def _target_continuations(target, prompt, n):
    """The target's distribution at each position of every `n - 1`-token continuation of `prompt`, in one
    forward: `p [V3 ** (n - 1), n, V]` (row `r`: the continuation spelling `r` in base V3, first token most
    significant; position `k` predicts its token `k + 1`)."""
    heads_RxK = np.array(list(itertools.product(range(V3), repeat=n - 1)))
    ids = jnp.asarray([[*prompt, *head] for head in heads_RxK])
    probs = np.asarray(jax.nn.softmax(target.logits(target(ids).hidden_BxTxH)), np.float64)
    return heads_RxK, probs[:, len(prompt) - 1 :]


def _target_joint(heads_RxK, p_RxKxV):
    """The target's probability of each of the `V3 ** n` continuations (first token most significant)."""
    n = p_RxKxV.shape[1]
    prefix_R = np.prod(np.take_along_axis(p_RxKxV[:, : n - 1], heads_RxK[..., None], axis=2)[..., 0], axis=1)
    return (prefix_R[:, None] * p_RxKxV[:, n - 1]).ravel()


def _target_conditional(p_RxKxV):
    """`conditional(prefix) -> p(next token | prompt + prefix) [V]`: the row of the first continuation
    that starts with `prefix`."""
    n = p_RxKxV.shape[1]
    return lambda prefix: p_RxKxV[
        int(np.dot(prefix, V3 ** np.arange(n - 2, n - 2 - len(prefix), -1))), len(prefix)
    ]


def _joint_sampling_pvalue(parts3, mesh, group, schedule, **kw):
    """Speculative sampling of `ROWS3` rows of `PROMPT3`: the chi-square p-value of their first `N3` tokens
    against the target's joint distribution, the per-position p-values (`per_position_pvalues`), and the
    decoder's report (`kw`: more decoder options)."""
    group_parts, draft, proposer = _group(parts3, mesh, group, DRAFT3, candidates=2)
    settings = _scheduled(S3) if schedule == "confidence" else {}
    decoder = _decoder(
        group_parts, mesh, ROWS3, draft, proposer, eos=V3, verify_buckets=(1, 2, 3, S3 + 1), **settings, **kw
    )
    if schedule == "confidence":  # a flatter table than `_decoder`'s: rows verify 0..S proposals
        n = np.arange(1, ROWS3 * (S3 + 1) + 1)
        decoder.sps_table = scheduler.SpsTable(ROWS3, 0, tuple(n), tuple(1.0 / (n + 8 * ROWS3)))
    outs = decoder.generate([PROMPT3] * ROWS3, max_new_tokens=N3, params=SamplingParams(1.0), seed=3)
    outs = np.asarray(outs)
    heads_RxK, p_RxKxV = _target_continuations(parts3[0], PROMPT3, N3)
    joint = chi_square_p(joint_cells(outs, V3), _target_joint(heads_RxK, p_RxKxV))
    return joint, per_position_pvalues(outs, _target_conditional(p_RxKxV)), decoder.report.as_dict()


@pytest.mark.parametrize(
    "group, schedule",
    tiered(
        [*((g, "fixed") for g in GROUPS), ("baseline", "confidence"), ("reranker_joint", "confidence")],
        fast=[("baseline", "fixed"), ("baseline", "confidence"), ("reranker_joint", "confidence")],
        slow=[("memory_with_memory", "fixed")],
    ),
    ids=lambda x: str(x),
)
def test_sampling_is_lossless_jointly_over_a_whole_cycle(parts3, mesh1, group, schedule):
    """The first six sampled tokens of every row, jointly (the prefill's and all a first cycle can emit;
    later ones read, with Draft Memory, the memory of the cycle before), follow the target's distribution:
    every accepted length, residual and bonus draw, under each proposer (the reranker samples from 2 of
    3 candidates) and the prefix scheduler's per-row verification cap."""
    p_value, positions, report = _joint_sampling_pvalue(parts3, mesh1, group, schedule)
    hist = report["accepted_length_histogram"]
    print(
        f"{group}/{schedule}: joint p={p_value:.4f}, per position {np.round(positions, 4)}, accepted {hist}"
    )
    assert p_value > 1e-3 and min(positions) > 1e-3 / N3
    assert all(hist[str(n)] >= 100 for n in range(1, S3 + 2)), hist  # every accepted length is sampled
    if schedule == "confidence":
        assert 0 < report["mean_verified_length"] < S3


@pytest.mark.parametrize(
    "group, schedule",
    tiered(
        [("baseline", "fixed"), ("baseline", "confidence"), ("memory_with_memory", "fixed")],
        fast=[("baseline", "fixed")],
        slow=[("memory_with_memory", "fixed")],
    ),
    ids=lambda x: str(x),
)
def test_sampling_on_a_hybrid_moe_target_is_lossless_jointly(hybrid_parts3, mesh1, group, schedule):
    """The joint test on a Qwen3-Next-shaped target: each row's linear-attention states are kept after its
    own accepted prefix, whatever was sampled (every accepted length occurs)."""
    p_value, positions, report = _joint_sampling_pvalue(hybrid_parts3, mesh1, group, schedule)
    hist = report["accepted_length_histogram"]
    print(f"hybrid {group}/{schedule}: joint p={p_value:.4f}, per position {np.round(positions, 4)}, {hist}")
    assert p_value > 1e-3 and min(positions) > 1e-3 / N3
    assert all(hist[str(n)] >= 100 for n in range(1, S3 + 2)), hist


@pytest.mark.parametrize(
    "rule", [biased_at_position_3, residual_biased_from_position_3], ids=lambda f: f.__name__
)
def test_the_sampling_tests_reject_a_rule_biased_from_position_3(parts3, mesh1, monkeypatch, rule):
    """Power check of the tests above: the engine with a rule that accepts a rejected fourth draft half of
    the time fails the joint test; one that draws the token after a rejection at draft position 3 or later
    from the target's distribution instead of the residual fails the per-position test (the joint test's
    729 cells dilute it: p 0.05-0.9)."""
    monkeypatch.setattr(engine, "accept_sampling", rule)
    p_value, positions, _ = _joint_sampling_pvalue(parts3, mesh1, "baseline", "fixed")
    print(f"{rule.__name__}: joint p={p_value:.2e}, per position {positions}")
    assert min(p_value, *positions) < 1e-6, (p_value, positions)
