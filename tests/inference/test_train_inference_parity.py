"""What decoding drafts is what training scores: at every cycle's anchor, the decoder's draft states and
its first proposal's corrected logits equal the training forward's on the same text (tiny target and
draft; docs/design.md section 1: the block at anchor `p` reads the target's states at `j < p`).

The decoder's draft context is built piecewise (prefill, then one verification forward per cycle, rolled
back to the accepted prefix); training reads one whole-sequence forward. An off-by-one in the context's
positions, its visibility, the anchor or the Markov predecessor makes them differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.groups.baseline import block_states
from dspark_jax.inference.timing import cycle_programs
from dspark_jax.target.generate import GREEDY, Generator
from tests.inference.test_speculate import AUX, EOS, PROMPTS, _decoder, parts  # noqa: F401

CYCLES = 6


def _training_view(target, draft, frozen, tokens, anchors):
    """Draft states `[N, S, H]` and slot-0 corrected logits `[N, V]` of the blocks at `anchors`, from one
    whole-sequence target forward over `tokens` (what the cache stores, in float32)."""
    tokens_1xT = jnp.asarray([tokens], jnp.int32)
    aux_1xTxAxH = target(tokens_1xT, aux_layer_ids=AUX).aux_BxTxAxH
    batch = {
        "input_ids": tokens_1xT,
        "loss_mask": jnp.ones_like(tokens_1xT),
        "positions": jnp.arange(len(tokens))[None],
        "aux_hidden": aux_1xTxAxH,
    }
    anchors_1xN = jnp.asarray([anchors], jnp.int32)
    targets, h_1xNxSxH = block_states(draft, frozen, batch, anchors_1xN, jnp.ones_like(anchors_1xN))
    heads = draft.heads(frozen, h_1xNxSxH[:, :, :1], targets.predecessors[..., :1])
    return np.asarray(h_1xNxSxH[0]), np.asarray(heads["logits"][0, :, 0])


@pytest.mark.parametrize("prompt", PROMPTS[:3], ids=range(3))
def test_every_cycle_drafts_the_states_training_scores_at_its_anchor(parts, mesh1, prompt):  # noqa: F811
    target, draft, frozen = parts
    decoder = _decoder(parts, mesh1, 1)
    settings = decoder.settings(CYCLES * (decoder.block_size + 1), GREEDY)
    batch = next(decoder.batches([list(prompt)]))
    max_len = decoder.max_len(batch.length, settings.max_new_tokens)
    run = cycle_programs(decoder, settings, max_len)
    ts, (_, dp, dr) = decoder.target_state, decoder.draft
    state = run.prefill(ts, dp, dr, batch.tokens_BxP, batch.lengths_B, batch.real_B, jax.random.key(0))
    anchors, states, logits = [], [], []
    for _ in range(CYCLES):
        if bool(state.done_B[0]):
            break
        draft_out = run.draft_pass(dp, dr, frozen, state)
        proposals = run.select(dp, dr, frozen, state, draft_out)
        anchors.append(int(state.target_cache.end_B[0]))
        states.append(np.asarray(draft_out[0]))
        logits.append(np.asarray(proposals.logits_BxSxV[0, 0]))
        state, _ = run.verify(ts, dp, dr, state, draft_out, proposals, None)
    emitted = [t for t in np.asarray(state.out_BxO[0]).tolist() if t >= 0]
    # The decoder's text is the target's greedy continuation (lossless), so training sees the same tokens.
    greedy = Generator(target, eos_ids=[EOS], pad_id=0, batch_size=1, mesh=mesh1)
    assert emitted == greedy.generate([list(prompt)], max_new_tokens=len(emitted))[0]
    assert len(anchors) >= 3 and anchors[0] == len(prompt)
    h_NxSxH, logits_NxV = _training_view(target, draft, frozen, [*prompt, *emitted], anchors)
    np.testing.assert_allclose(np.stack(states), h_NxSxH, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.stack(logits), logits_NxV, rtol=1e-4, atol=1e-3)
