"""The frozen target LLM: config, checkpoint readers, NNX model, tokenizer, chat template."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
from jax.sharding import Mesh

from dspark_jax import sharding
from dspark_jax.nn import Dtype
from dspark_jax.target.chat import ChatTemplate
from dspark_jax.target.checkpoint import default_target_path, load_checkpoint
from dspark_jax.target.config import TargetConfig
from dspark_jax.target.load import model_from_checkpoint
from dspark_jax.target.model import KVCache, TargetOutput, Transformer
from dspark_jax.target.tokenizer import Tokenizer

__all__ = ["KVCache", "Target", "TargetConfig", "TargetOutput", "Tokenizer", "Transformer", "load_target"]


@dataclasses.dataclass
class Target:
    """A loaded target: the model, its tokenizer and chat template, and where it came from."""

    model: Transformer
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    source: str
    fingerprint: str

    @property
    def config(self) -> TargetConfig:
        return self.model.cfg


def load_target(
    path: str | Path | None = None,
    *,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    param_dtype: Dtype = jnp.float32,
    dtype: Dtype = jnp.float32,
) -> Target:
    """Loads a target from a Hugging Face directory or GGUF file (the embedded default if None)."""
    path = Path(path) if path is not None else default_target_path()
    ckpt = load_checkpoint(path)
    model = model_from_checkpoint(ckpt, mesh=mesh, rules=rules, param_dtype=param_dtype, dtype=dtype)
    if path.suffix == ".gguf":
        tokenizer = Tokenizer.from_gguf(path)
    else:
        tokenizer = Tokenizer.from_tokenizer_json(path / "tokenizer.json")
    return Target(model, tokenizer, ChatTemplate.for_tokenizer(tokenizer), str(path), ckpt.fingerprint())
