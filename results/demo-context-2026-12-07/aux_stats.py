"""The scale of SmolLM2-135M's aux states (massive activations) and what a random context projection makes of
them.

  python results/demo-context-2026-12-07/aux_stats.py

One forward of the embedded target over the first 400 tokens of six GSM8K-256 questions; per layer: the token
RMS, the largest per-dimension RMS against the median one, the share of the states' energy in their mean
vector (a direction every token shares) and the tokens' mean pairwise cosine. Then the demo draft's context at
a random init, `RMSNorm(W [h26; h27; h28])` with W ~ N(0, 0.02^2), for the states as they are and standardised
per dimension.
"""

import json

import jax.numpy as jnp
import numpy as np

from dspark_jax.data.conversations import GSM8K_VAL256
from dspark_jax.target import load_target


def cosine(x):
    n = x / np.linalg.norm(x, axis=1, keepdims=True)
    return (n @ n.T)[np.triu_indices(len(x), 1)].mean()


def normed(x):
    return x / np.sqrt((x**2).mean(1, keepdims=True))


target = load_target()
with open(GSM8K_VAL256) as f:
    text = " ".join(json.loads(line)["turns"][0] for line in f.readlines()[:6])
ids = np.asarray(target.tokenizer.encode(text))[:400][None]
layers = (5, 15, 24, 26, 27, 28, 29)
aux = np.asarray(target.model(jnp.asarray(ids), aux_layer_ids=layers).aux_BxTxAxH[0, 1:], np.float64)
for i, layer in enumerate(layers):
    a = aux[:, i]
    rms_d = np.sqrt((a**2).mean(0))
    top = np.argsort(rms_d)[::-1][:3]
    share = (a.mean(0) ** 2).sum() / (a**2).sum(1).mean()
    print(
        f"layer {layer}: token RMS {np.sqrt((a**2).mean()):.1f}; dims {top.tolist()} RMS "
        f"{np.round(rms_d[top], 1).tolist()} against the median {np.median(rms_d):.1f}; mean-vector share "
        f"{share:.3f}; mean pairwise cosine {cosine(a):.3f}"
    )
cat = aux[:, 3:6].reshape(len(aux), -1)  # the demo's aux layers 26, 27, 28
w = np.random.default_rng(0).normal(0, 0.02, (cat.shape[1], cat.shape[1] // 3))
print(f"context at a random init: mean pairwise cosine {cosine(normed(cat @ w)):.3f}")
print(
    f"the same, inputs standardised per dimension: {cosine(normed(cat / np.sqrt((cat**2).mean(0)) @ w)):.3f}"
)
