"""The full-attention Qwens: Qwen2/2.5 (q/k/v biases), Qwen3 dense (per-head q/k RMSNorm) and Qwen3-MoE
(Qwen3's attention; the MLP of every `decoder_sparse_step`-th layer, but those in `mlp_only_layers`, is a
sparse mixture of experts)."""

from dspark_jax.target.families.registry import Family, register

QWEN2 = register(
    Family(name="qwen2", model_types=("qwen2",), gguf_architectures=("qwen2",), attention_bias=True)
)
QWEN3 = register(Family(name="qwen3", model_types=("qwen3",), gguf_architectures=("qwen3",), qk_norm=True))
QWEN3_MOE = register(Family(name="qwen3_moe", model_types=("qwen3_moe",), qk_norm=True, moe=True))
