"""Reading GGUF files: metadata and (dequantised) tensors."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Opens a GGUF file (memory-mapped), with a clear error for a missing or broken file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct.error/IndexError on truncation.
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields of a GGUF file as plain Python values (str, int, float, lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


# GGUF tensor name -> canonical (Hugging Face Llama/Qwen) name; `{i}` is the layer index.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def canonical_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (e.g. 'blk.3.attn_q.weight' ->
    'model.layers.3.self_attn.q_proj.weight'), or None for a tensor outside the mapping."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    return None


def gguf_name(canonical: str) -> str | None:
    """Inverse of `canonical_name`: the GGUF name of a Hugging Face tensor name, or None."""
    for short, hf in _GGUF_GLOBAL_NAMES.items():
        if hf == canonical:
            return short
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", canonical)
    if match:
        for short, hf in _GGUF_LAYER_NAMES.items():
            if hf == match.group(2):
                return f"blk.{match.group(1)}.{short}"
    return None


def tensor_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """Logical shape in numpy/torch order (`[out, in]` for a linear weight); GGUF stores it reversed."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


@functools.cache
def is_dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether `gguf.quants.dequantize` handles `qtype` (probed on one all-zero block).

    True for F32, F16, BF16 and the quantised types of the installed `gguf` package (Q4_0, Q4_1,
    Q8_0, the K-quants, IQ types, ...); False for integer, F64 and intermediate types like Q8_K.
    """
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor's values as a new float32 array of shape `tensor_shape(tensor)`."""
    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    if np.may_share_memory(values, tensor.data):
        values = values.copy()  # F32 comes back as a view of the memory-mapped file.
    return values.reshape(tensor_shape(tensor))


def _check_head_rows(weights: np.ndarray, n_head: int) -> None:
    if weights.shape[0] % (2 * n_head):
        raise ValueError(f"cannot split {weights.shape[0]} rows into {n_head} heads of even width")


def llama_permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of Hugging Face q/k rows (weights or bias) to its interleaved RoPE order.

    Mirrors `LlamaModel.permute` of llama.cpp's `convert_hf_to_gguf.py`; `n_head` is the number
    of query heads for `q_proj` and of key/value heads for `k_proj`.
    """
    _check_head_rows(weights, n_head)
    split = weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
    return split.swapaxes(1, 2).reshape(weights.shape)


def llama_unpermute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `llama_permute_qk`: GGUF 'llama' q/k rows back to the Hugging Face layout."""
    _check_head_rows(weights, n_head)
    split = weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
    return split.swapaxes(1, 2).reshape(weights.shape)
