"""Llama 3 (and SmolLM2): every layer full attention and SwiGLU, no biases, no q/k norm. llama.cpp's GGUF
converter reorders its q/k projection rows for an interleaved RoPE."""

from dspark_jax.target.families.registry import Family, register

LLAMA = register(
    Family(name="llama", model_types=("llama",), gguf_architectures=("llama",), gguf_qk_permuted=True)
)
