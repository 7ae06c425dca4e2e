"""Target model parity with `transformers` (independent implementation) on tiny random models."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dspark_jax.target.checkpoint import load_checkpoint, save_hf_checkpoint
from dspark_jax.target.load import model_from_checkpoint
from dspark_jax.target.model import DecodeCache

VOCAB = 101
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama3_scaled": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24),
}


def _random_pair(kind, tmp_path, mesh, shard_size=None):
    """A random transformers model and our model loaded from its safetensors."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    tensors = {k: v.numpy() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_hf_checkpoint(tmp_path, hf.config.to_dict(), tensors, shard_size_bytes=shard_size)
    return hf, model_from_checkpoint(load_checkpoint(tmp_path), mesh=mesh)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_and_layers_match_transformers(kind, tmp_path, mesh1):
    hf, model = _random_pair(kind, tmp_path, mesh1, shard_size=200_000)
    ids = np.random.RandomState(1).randint(0, VOCAB, (2, 40))
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.update(last=o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_hidden_states=True)
    hook.remove()
    out = model(jnp.asarray(ids), aux_layer_ids=(-1, 0, 1, 2))
    np.testing.assert_allclose(
        np.asarray(model.logits(out.hidden_BxTxH)), ref.logits.numpy(), atol=2e-5, rtol=1e-4
    )
    aux = np.asarray(out.aux_BxTxAxH)
    # transformers' hidden_states: [embeddings, layer 0 out, ..., layer L-2 out, norm(layer L-1 out)].
    np.testing.assert_allclose(aux[:, :, 0], ref.hidden_states[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(aux[:, :, 1], ref.hidden_states[1].numpy(), atol=2e-5)
    np.testing.assert_allclose(aux[:, :, 2], ref.hidden_states[2].numpy(), atol=2e-5)
    np.testing.assert_allclose(aux[:, :, 3], captured["last"].numpy(), atol=2e-5)  # pre-final-norm
    np.testing.assert_allclose(np.asarray(out.hidden_BxTxH), ref.hidden_states[3].numpy(), atol=2e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_kv_cache_decode_matches_full_forward(kind, tmp_path, mesh1):
    _, model = _random_pair(kind, tmp_path, mesh1)
    ids = jnp.asarray(np.random.RandomState(2).randint(0, VOCAB, (3, 20)))
    full = model.logits(model(ids).hidden_BxTxH)
    cache = DecodeCache.zeros(model.cfg, 3, 32, jnp.float32)
    out = model(ids[:, :9], cache=cache)
    pieces = [out.hidden_BxTxH]
    cache = out.cache
    for t in range(9, 20, 4):  # blocks of up to 4 tokens, as in speculative verification
        out = model(ids[:, t : t + 4], cache=cache)
        cache = out.cache
        pieces.append(out.hidden_BxTxH)
    np.testing.assert_allclose(
        np.asarray(model.logits(jnp.concatenate(pieces, 1))), np.asarray(full), atol=2e-5
    )
    np.testing.assert_array_equal(np.asarray(cache.end_B), [20, 20, 20])


def test_left_and_right_padding_match_unpadded(tmp_path, mesh1):
    _, model = _random_pair("qwen2", tmp_path, mesh1)
    rng = np.random.RandomState(3)
    rows = [rng.randint(0, VOCAB, n) for n in (5, 12)]
    ref = [np.asarray(model.logits(model(jnp.asarray(r[None])).hidden_BxTxH))[0] for r in rows]
    width = 12
    left = np.zeros((2, width), np.int32)
    right = np.zeros((2, width), np.int32)
    valid_left = np.zeros((2, width), bool)
    valid_right = np.zeros((2, width), bool)
    for b, r in enumerate(rows):
        left[b, width - len(r) :], valid_left[b, width - len(r) :] = r, True
        right[b, : len(r)], valid_right[b, : len(r)] = r, True
    out_left = np.asarray(
        model.logits(model(jnp.asarray(left), valid_BxT=jnp.asarray(valid_left)).hidden_BxTxH)
    )
    out_right = np.asarray(
        model.logits(model(jnp.asarray(right), valid_BxT=jnp.asarray(valid_right)).hidden_BxTxH)
    )
    for b, r in enumerate(rows):
        np.testing.assert_allclose(out_left[b, width - len(r) :], ref[b], atol=2e-5)
        np.testing.assert_allclose(out_right[b, : len(r)], ref[b], atol=2e-5)
