"""A decoding-time draft vocabulary: the draft proposes only its tokens, each the choice the whole
vocabulary's corrected logits make among them, and decoding stays lossless (tiny target and draft)."""

import types

import jax
import numpy as np
import pytest

from configs import baseline
from dspark_jax.inference import vocabulary
from dspark_jax.inference.timing import cycle_programs
from dspark_jax.run import target_side
from dspark_jax.target.generate import GREEDY, Generator
from tests.inference.test_sampling_joint import _joint_sampling_pvalue, parts3  # noqa: F401
from tests.inference.test_speculate import (  # noqa: F401
    EOS,
    GROUPS,
    PROMPTS,
    V,
    _decoder,
    _group,
    parts,
)
from tests.marks import tiered

# 16 of the 48 ids (EOS among them), not a contiguous range: a wrong id mapping proposes outside it.
VOCAB = np.asarray(sorted({EOS, *range(4, V, 3)}))[:16]


def test_most_frequent_ranks_by_count_ties_to_the_lower_id_and_adds_the_eos_ids():
    counts = np.asarray([5, 0, 3, 3, 9, 0, 1])
    np.testing.assert_array_equal(vocabulary.most_frequent(counts, 3), [0, 2, 4])  # 2 and 3 tie: 2
    np.testing.assert_array_equal(vocabulary.most_frequent(counts, 3, always=(5,)), [0, 2, 4, 5])
    assert vocabulary.coverage(counts, np.asarray([0, 2, 4, 5])) == pytest.approx(17 / 21)
    for size in (0, 8):
        with pytest.raises(ValueError, match=r"draft vocabulary size must be in 1..7 \(the vocabulary\)"):
            vocabulary.most_frequent(counts, size)


def _reference_choices(draft, frozen, h_SxH, anchor, top_k):
    """Greedy choices slot by slot from the whole vocabulary's base and Markov-corrected logits, restricted
    to `VOCAB` (and, with `top_k`, to its `top_k` best base logits), in numpy."""
    base_SxV = np.asarray(draft.base_logits(frozen, h_SxH))
    choices, previous = [], anchor
    for i, base_V in enumerate(base_SxV):
        corrected_V = np.asarray(
            draft.corrected(base_V[None], h_SxH[i : i + 1], np.asarray([previous]))["logits"]
        )[0]
        allowed = VOCAB if not top_k else VOCAB[np.argsort(-base_V[VOCAB], kind="stable")[:top_k]]
        previous = int(allowed[np.argmax(corrected_V[allowed])])
        choices.append(previous)
    return choices


@pytest.mark.parametrize("top_k", [0, 4])
def test_proposals_are_the_whole_vocabularys_best_corrected_choice_among_the_draft_vocabulary(
    parts,  # noqa: F811
    mesh1,
    top_k,
):
    _, draft, frozen = parts
    decoder = _decoder(parts, mesh1, 1, draft_vocab=VOCAB, select_top_k=top_k)
    settings = decoder.settings(32, GREEDY)
    for prompt in PROMPTS[:2]:
        batch = next(decoder.batches([prompt]))
        max_len = decoder.max_len(batch.length, settings.max_new_tokens)
        run = cycle_programs(decoder, settings, max_len)
        ts, (_, dp, dr) = decoder.target_state, decoder.draft
        state = run.prefill(ts, dp, dr, batch.tokens_BxP, batch.lengths_B, batch.real_B, jax.random.key(0))
        for _ in range(3):
            draft_out = run.draft_pass(dp, dr, decoder.frozen, state)
            proposals = run.select(dp, dr, decoder.frozen, state, draft_out)
            got = np.asarray(proposals.drafts_BxS[0]).tolist()
            assert set(got) <= set(VOCAB.tolist()), got
            assert got == _reference_choices(draft, frozen, draft_out[0], int(state.pending_B[0]), top_k)
            state, _ = run.verify(ts, dp, dr, state, draft_out, proposals, None)


@pytest.mark.parametrize("group", tiered(GROUPS, fast=["baseline"], slow=["reranker_joint"]))
def test_greedy_with_a_draft_vocabulary_equals_the_target_greedy(parts, mesh1, group):  # noqa: F811
    """Every group's proposer stays lossless (the reranker rescoring 4 candidates of the draft vocabulary,
    fewer than its 16)."""
    prompts = PROMPTS * 2
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=8, mesh=mesh1).generate(
        prompts, max_new_tokens=20
    )
    group_parts, draft, proposer = _group(parts, mesh1, group)
    decoder = _decoder(group_parts, mesh1, 8, draft, proposer, draft_vocab=VOCAB, select_top_k=4)
    assert decoder.generate(prompts, max_new_tokens=20) == expected
    assert decoder.draft_vocab_size == len(VOCAB)


def test_sampling_from_a_draft_vocabulary_is_lossless_jointly(parts3, mesh1):  # noqa: F811
    """The joint test of `test_sampling_joint` with the draft restricted to 2 of the 3 tokens: its
    distribution is zero on the third, which the target still samples through the residual."""
    p_value, positions, report = _joint_sampling_pvalue(
        parts3, mesh1, "baseline", "fixed", draft_vocab=(0, 2)
    )
    print(
        f"draft vocabulary (0, 2): joint p={p_value:.4f}, per position {positions}, "
        f"accepted lengths {report['accepted_length_histogram']}"
    )
    assert p_value > 1e-3 and min(positions) > 1e-3 / len(positions)


def test_a_draft_vocabulary_without_the_training_cache_is_refused_with_the_fix(tmp_path):
    config = baseline.get_config("smoke")
    config.data.cache_dir = str(tmp_path)
    with pytest.raises(
        ValueError, match=r"ranks the training cache's tokens, and .*train_cache-.* is not there: "
    ):
        # The side's identity is all the cache path needs: no target is loaded before the refusal.
        shape = types.SimpleNamespace(vocab_size=V)
        side = types.SimpleNamespace(fingerprint="0" * 12, config=shape, eos_ids=())
        target_side.training_vocabulary(config, side, 8)


def test_bad_draft_vocabularies(parts, mesh1):  # noqa: F811
    for ids, match in (
        ([], "draft_vocab must be a non-empty list of token ids"),
        ([1, 1, 2], r"draft_vocab must hold distinct token ids in 0..47"),
        ([0, V], r"draft_vocab must hold distinct token ids in 0..47"),
    ):
        with pytest.raises(ValueError, match=match):
            _decoder(parts, mesh1, 1, draft_vocab=ids)
