"""One speculative cycle, slot by slot, for people: what the draft proposed, what its group's sequential
correction chose, how confident it was, and what the target accepted.

Runs the decoder's own phases (prefill, the proposer's draft pass and selection, verification) once on one
prompt, so the table shows exactly what decoding computes; the draft's uncorrected choice is the argmax of
its base logits `l0` (before the Markov head and anything the group adds to the selection).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.inference.timing import cycle_programs
from dspark_jax.target.generate import GREEDY, SamplingParams

TOP = 3  # candidates reported per slot


def _probabilities(logits_V: np.ndarray) -> np.ndarray:
    p_V = np.exp(logits_V - logits_V.max())
    return p_V / p_V.sum()


def walk_cycle(
    decoder: SpeculativeDecoder,
    prompt: Sequence[int],
    *,
    params: SamplingParams = GREEDY,
    seed: int = 0,
) -> dict:
    """The first cycle after prefilling `prompt`: `anchor` (the pending token the block starts from),
    `accepted` (proposals the target kept), `emitted` (the tokens the cycle appended: the accepted
    proposals and the target's own next token) and `slots`, one dict per proposal with `base` /
    `base_prob` (the draft's own argmax), `proposal` / `proposal_prob` (the group's corrected choice and
    its probability in the distribution it was drawn from), `top` (that distribution's `TOP` most likely
    `(token, probability)` pairs, most likely first, ties to the lower token; greedy: the proposal first),
    `confidence` (the head's sigmoid, raw) and `accepted`."""
    settings = decoder.settings(8 * (decoder.block_size + 1), params)
    batch = next(decoder.batches([list(prompt)]))
    max_len = decoder.max_len(batch.length, settings.max_new_tokens)
    sps_N = decoder.sps(max_len) if settings.verify_buckets else None
    run = cycle_programs(decoder, settings, max_len)
    ts, (_, dp, dr), frozen = decoder.target_state, decoder.draft, decoder.frozen
    state = run.prefill(ts, dp, dr, batch.tokens_BxP, batch.lengths_B, batch.real_B, jax.random.key(seed))
    draft_out = run.draft_pass(dp, dr, frozen, state)
    proposals = run.select(dp, dr, frozen, state, draft_out)
    new_state, accepted_B = run.verify(ts, dp, dr, state, draft_out, proposals, sps_N)
    h_BxSxH = draft_out["h"] if isinstance(draft_out, dict) else draft_out
    graphdef = decoder.draft[0]
    base_BxSxV = jax.jit(lambda p, r, f, h: nnx.merge(graphdef, p, r).base_logits(f, h))(
        dp, dr, frozen, h_BxSxH
    )
    state, new_state, base_BxSxV, proposals, accepted_B = jax.device_get(
        (state, new_state, base_BxSxV, proposals, accepted_B)
    )
    accepted = int(accepted_B[0])
    start, stop = int(state.count_B[0]), int(new_state.count_B[0])
    base = np.asarray(base_BxSxV[0], np.float32)
    final = np.asarray(proposals.logits_BxSxV[0], np.float32)
    slots = []
    for i, token in enumerate(np.asarray(proposals.drafts_BxS[0]).tolist()):
        base_V, final_V = _probabilities(base[i]), _probabilities(final[i])
        base_token = int(base_V.argmax())
        slots.append(
            {
                "base": base_token,
                "base_prob": float(base_V[base_token]),
                "proposal": token,
                "proposal_prob": float(final_V[token]),
                "top": [(int(t), float(final_V[t])) for t in np.argsort(-final_V, kind="stable")[:TOP]],
                "confidence": float(jax.nn.sigmoid(proposals.confidence_logit_BxS[0, i])),
                "accepted": i < accepted,
            }
        )
    return {
        "anchor": int(state.pending_B[0]),
        "accepted": accepted,
        "emitted": np.asarray(new_state.out_BxO[0, start:stop]).tolist(),
        "slots": slots,
    }
