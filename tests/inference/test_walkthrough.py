"""One cycle walked slot by slot: what it reports is what decoding does (tiny target and draft)."""

import numpy as np
import pytest

from dspark_jax.groups.memory.group import MEMORY_PROPOSER
from dspark_jax.groups.reranker.group import RERANKER_PROPOSER
from dspark_jax.inference.walkthrough import walk_cycle
from dspark_jax.target.generate import Generator
from tests.inference.test_speculate import EOS, PROMPTS, _decoder, _memory_draft, _reranker_draft, parts  # noqa: F401


@pytest.mark.parametrize("group", ["baseline", "memory", "reranker"])
def test_one_cycle_reports_the_target_greedy_tokens_and_the_leading_matches(parts, mesh1, group):  # noqa: F811
    draft, proposer = {
        "baseline": (None, None),
        "memory": (_memory_draft(mesh1, "with_memory"), MEMORY_PROPOSER),
        "reranker": (_reranker_draft(mesh1), RERANKER_PROPOSER),
    }[group]
    kw = {} if draft is None else {"draft": draft, "proposer": proposer}
    decoder = _decoder(parts, mesh1, 1, **kw)
    target_greedy = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=1, mesh=mesh1)
    for prompt in PROMPTS:
        expected = target_greedy.generate([prompt], max_new_tokens=12)[0]
        walked = walk_cycle(decoder, prompt)
        proposals = [s["proposal"] for s in walked["slots"]]
        matches = next((i for i, (d, t) in enumerate(zip(proposals, expected[1:])) if d != t), len(proposals))
        assert walked["anchor"] == expected[0]
        assert walked["accepted"] == matches
        assert [s["accepted"] for s in walked["slots"]] == [i < matches for i in range(len(proposals))]
        emitted = [t for t in walked["emitted"] if t != EOS]
        assert emitted == expected[1 : 1 + len(emitted)] and len(walked["emitted"]) == matches + 1
        for s in walked["slots"]:
            assert 0.0 < s["confidence"] < 1.0 and 0.0 < s["base_prob"] <= 1.0
            # Greedy: the proposal is the most likely token of the distribution it was drawn from.
            assert s["top"][0] == (s["proposal"], s["proposal_prob"]), (s["proposal"], s["top"])
            assert s["top"][0][1] > s["top"][1][1] and np.isfinite(s["proposal_prob"])  # a tie: vacuous
