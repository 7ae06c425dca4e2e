"""A toy target family, added by this file alone: one `Family` record registered under a made-up
`model_type` loads through the normal checkpoint path, and nothing outside this file names it. The toy is
Llama with a per-head q/k RMSNorm, Qwen3's attention under another name, so the same weights loaded as
Qwen3 must give the same logits."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target import families
from dspark_jax.target.checkpoint import load_checkpoint, save_hf_checkpoint
from dspark_jax.target.config import TargetConfig, UnsupportedModelError, from_hf_config
from dspark_jax.target.load import model_from_checkpoint
from tests.target.test_checkpoint import random_tensors, tiny_config_json

TOY = families.Family(name="toy_llama", model_types=("toy_llama", "toy_llama_text"), qk_norm=True)


@pytest.fixture
def toy():
    """The toy family, registered for one test and removed after it."""
    yield families.register(TOY)
    del families.FAMILIES[TOY.name]


def _model(directory, config_json, tensors, mesh):
    return model_from_checkpoint(
        load_checkpoint(save_hf_checkpoint(directory, config_json, tensors)), mesh=mesh
    )


def test_the_toy_family_loads_and_runs_as_the_family_it_mimics(toy, tmp_path, mesh1):
    config_json = tiny_config_json("toy_llama_text")
    tensors = random_tensors(from_hf_config(config_json))
    assert "model.layers.1.self_attn.k_norm.weight" in tensors  # the record's q/k norm reached the shapes
    model = _model(tmp_path / "toy", config_json, tensors, mesh1)
    as_qwen3 = _model(tmp_path / "qwen3", config_json | {"model_type": "qwen3"}, tensors, mesh1)
    assert model.cfg.family == "toy_llama"
    assert dataclasses.replace(model.cfg, family="qwen3") == as_qwen3.cfg
    ids_BxT = jnp.asarray(np.random.RandomState(0).randint(0, config_json["vocab_size"], (2, 12)))
    np.testing.assert_allclose(
        np.asarray(model.logits(model(ids_BxT).hidden_BxTxH)),
        np.asarray(as_qwen3.logits(as_qwen3(ids_BxT).hidden_BxTxH)),
        rtol=1e-6,
        atol=1e-6,
    )


def test_an_unregistered_model_type_is_refused_in_one_line_naming_the_registered_ones(toy, tmp_path):
    tensors = random_tensors(from_hf_config(tiny_config_json("llama")))
    directory = save_hf_checkpoint(tmp_path, tiny_config_json("toy_mamba"), tensors)
    with pytest.raises(UnsupportedModelError) as refused:
        load_checkpoint(directory)
    message = str(refused.value)
    assert "\n" not in message and "model_type 'toy_mamba' is not supported; supported: [" in message
    assert all(repr(model_type) in message for model_type in [*families.by_model_type(), *TOY.model_types])


def test_a_family_may_not_take_a_registered_name_or_model_type(toy):
    with pytest.raises(ValueError, match=r"target family 'toy_llama' is already registered"):
        families.register(dataclasses.replace(TOY, model_types=("toy_2",)))
    with pytest.raises(ValueError, match=r"target family 'toy_2': \['llama', 'toy_llama'\] already name a"):
        families.register(dataclasses.replace(TOY, name="toy_2", model_types=("llama", "toy_llama")))


def test_the_toy_is_gone_once_its_tests_are_done():
    assert TOY.name not in families.FAMILIES
    with pytest.raises(
        UnsupportedModelError, match=r"unknown target family 'toy_llama'; supported: \['llama'"
    ):
        TargetConfig.from_json(dict(from_hf_config(tiny_config_json("llama")).to_json(), family="toy_llama"))
