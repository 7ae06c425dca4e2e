"""Prefix reranker, joint training (experiment group 6): the draft and a prefix reranker over its top-16
candidates, trained together from scratch.

  python -m dspark_jax.train --config=configs/reranker_joint.py          # :demo
  python -m dspark_jax.train --config=configs/reranker_joint.py:smoke    # tiny random target (seconds)

Loss: the baseline's plus the rank loss (candidate-set CE on the teacher argmax); `tau_prob` is of the
reranked distribution, `pre_rerank_tau_prob` of the full-vocabulary one (dspark_jax/groups/reranker/group.py).
Extra keys: draft.rerank_candidates (16), draft.rerank_width (256; 32 in :smoke), draft.rerank_heads (4),
draft.rerank_ffn (4 x width). Speculative decoding draws each token from the reranked candidates.
"""

from configs import base


def get_config(preset: str = "demo"):
    config = base.get_config(preset)
    with config.unlocked():
        config.experiment = "reranker_joint"
        width = 32 if preset == "smoke" else 256
        config.draft.rerank_candidates = 16
        config.draft.rerank_width = width
        config.draft.rerank_heads = 4
        config.draft.rerank_ffn = 4 * width
    return config
