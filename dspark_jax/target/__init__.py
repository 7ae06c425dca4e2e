"""The frozen target LLM: config, checkpoint readers, NNX model, tokenizer, chat template."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dspark_jax import sharding
from dspark_jax.nn import Dtype
from dspark_jax.target.chat import ChatTemplate
from dspark_jax.target.checkpoint import default_target_path, load_checkpoint
from dspark_jax.target.config import TargetConfig
from dspark_jax.target.load import model_from_checkpoint
from dspark_jax.target.model import DecodeCache, TargetOutput, Transformer
from dspark_jax.target.tokenizer import Tokenizer

__all__ = [
    "DecodeCache",
    "Target",
    "TargetConfig",
    "TargetOutput",
    "Tokenizer",
    "Transformer",
    "load_target",
    "random_target",
    "target_from_config",
]


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

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return eos_ids(self.config, self.tokenizer)


def eos_ids(config: TargetConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """Tokens that end a reply: the checkpoint's EOS ids and the tokenizer's."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return tuple(sorted(ids))


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
    tokenizer = _tokenizer_for(path)
    return Target(model, tokenizer, ChatTemplate.for_tokenizer(tokenizer), str(path), ckpt.fingerprint())


def _tokenizer_for(path: Path) -> Tokenizer:
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_tokenizer_json(path / "tokenizer.json")


def load_tokenizer(config) -> tuple[Tokenizer, ChatTemplate, TargetConfig]:
    """A config `target` section's tokenizer, chat template and shape, without loading any weights."""
    path = Path(config.path) if config.path else default_target_path()
    tokenizer = _tokenizer_for(path)
    shape = (
        TargetConfig.from_json(config.arch.to_dict()) if config.random_init else load_checkpoint(path).config
    )
    return tokenizer, ChatTemplate.for_tokenizer(tokenizer), shape


def random_target(
    arch: Mapping[str, Any],
    *,
    seed: int,
    tokenizer_path: str | Path | None = None,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    param_dtype: Dtype = jnp.float32,
    dtype: Dtype = jnp.float32,
) -> Target:
    """A randomly initialised target of shape `arch` (TargetConfig fields), for tests and smoke runs.

    The tokenizer and chat template come from `tokenizer_path` (the embedded default if None);
    its vocabulary must fit the random model's.
    """
    cfg = TargetConfig.from_json(arch)
    path = Path(tokenizer_path) if tokenizer_path else default_target_path()
    tokenizer = _tokenizer_for(path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer of {path} has {tokenizer.vocab_size} tokens but the random target's "
            f"vocab_size is {cfg.vocab_size}"
        )
    model = Transformer(cfg, rngs=nnx.Rngs(seed), param_dtype=param_dtype, dtype=dtype)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, sharding.state_shardings(state, mesh or sharding.make_mesh(), rules))
    identity = json.dumps({"random_target": cfg.to_json(), "seed": seed}, sort_keys=True)
    return Target(
        nnx.merge(graphdef, state),
        tokenizer,
        ChatTemplate.for_tokenizer(tokenizer),
        f"random:{seed}",
        hashlib.sha256(identity.encode()).hexdigest(),
    )


def target_from_config(
    config, *, seed: int, mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES
) -> Target:
    """The target described by a config's `target` section (see configs/base.py)."""
    dtypes = dict(param_dtype=jnp.dtype(config.param_dtype), dtype=jnp.dtype(config.dtype))
    if config.random_init:
        return random_target(
            config.arch.to_dict(),
            seed=seed,
            tokenizer_path=config.path or None,
            mesh=mesh,
            rules=rules,
            **dtypes,
        )
    return load_target(config.path or None, mesh=mesh, rules=rules, **dtypes)
