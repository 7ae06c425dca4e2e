"""Tiny random `transformers` models of the sparse and hybrid families (Qwen3-MoE, Qwen3-Next, Qwen 3.5,
Qwen 3.5-MoE), saved as Hugging Face checkpoints, and their per-layer outputs: the references of the
target's parity tests and of the hybrid cache test."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.references import reference

torch = reference("torch")
transformers = reference("transformers")

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
ATTENTION = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
LINEAR = dict(
    layer_types=LAYERS,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)


def _qwen3_moe(vocab_size):
    return transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **ATTENTION,
            **EXPERTS,
            vocab_size=vocab_size,
            intermediate_size=48,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    )


def _qwen3_next(vocab_size):
    return transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(
            **ATTENTION,
            **LINEAR,
            **EXPERTS,
            vocab_size=vocab_size,
            intermediate_size=48,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
        )
    )


def _qwen3_5(vocab_size):
    """Qwen 3.5 as published: the multimodal wrapper (text under `model.language_model.`, a vision tower)."""
    text = dict(**ATTENTION, **LINEAR, vocab_size=vocab_size, intermediate_size=48)
    return transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    )


def _qwen3_5_moe(vocab_size):
    text = dict(**ATTENTION, **LINEAR, **EXPERTS, vocab_size=vocab_size, shared_expert_intermediate_size=24)
    return transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    )


FAMILIES = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
}
LINEAR_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]  # those with Gated DeltaNet layers


def save_random(family: str, directory: Path, vocab_size: int):
    """A random `family` model (every parameter drawn, so norms, gates and decays are all non-trivial),
    saved to `directory`; returned in eval mode."""
    torch.manual_seed(0)
    hf = FAMILIES[family](vocab_size).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if name.endswith(("A_log", "dt_bias")) else 0.1)
    hf.save_pretrained(directory)
    return hf


def _text_model(hf):
    return hf.model.language_model if hasattr(hf.model, "language_model") else hf.model


def forward(hf, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Logits, every decoder layer's output (before the final norm) and the final normed state of the
    transformers model, positions counted from each row's first real token."""
    captured = []
    hooks = [
        layer.register_forward_hook(lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o))
        for layer in _text_model(hf).layers
    ]
    positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
            output_hidden_states=True,
        )
    for hook in hooks:
        hook.remove()
    final = out.hidden_states[-1].float().numpy()
    return out.logits.float().numpy(), [c.float().numpy() for c in captured], final
