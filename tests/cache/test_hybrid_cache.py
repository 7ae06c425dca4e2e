"""A cache built from a hybrid MoE target (a tiny random Qwen3-Next checkpoint loaded through
`target.path`) holds transformers' hidden states of the same sequences, and a smoke run trains on it."""

import json

import numpy as np
import pytest

from configs import baseline
from dspark_jax.cache import CacheDataSource
from dspark_jax.cache.build import build_cache, cache_spec, tokenize_all
from dspark_jax.target import load_target
from dspark_jax.training.loop import train
from dspark_jax.training.summary import SUMMARY_FILE
from tests.cache.test_build import CONVERSATIONS
from tests.references import reference
from tests.target import hf_hybrid

transformers = reference("transformers")

AUX = (0, 1, 2)  # Gated DeltaNet, full attention, Gated DeltaNet: inner layers of both kinds
BF16_STEP = 2.0**-7  # bf16 keeps 8 significant bits: rounding moves a value by at most half this, relative


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Qwen3-Next checkpoint with SmolLM2's tokenizer (its vocabulary, chat template) beside it."""
    from tests.target.test_tokenizer import GGUF_DIR, GGUF_NAME

    directory = tmp_path_factory.mktemp("qwen3_next")
    tokenizer = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    tokenizer.save_pretrained(directory)
    hf = hf_hybrid.save_random("qwen3_next", directory, vocab_size=len(tokenizer))
    return directory, hf


@pytest.fixture(scope="module")
def cache(checkpoint, tmp_path_factory, mesh1):
    """The cache of CONVERSATIONS built by the cache builder (several samples per forward, right-padded to
    a length bucket) from the checkpoint loaded through `load_target`."""
    directory, _ = checkpoint
    target = load_target(directory, mesh=mesh1)
    assert target.config.family == "qwen3_next"
    samples = tokenize_all(target, CONVERSATIONS, max_length=96)
    path = str(tmp_path_factory.mktemp("hybrid_cache") / "c")
    build_cache(path, target, samples, cache_spec(target, AUX, num_shards=2), mesh=mesh1, progress=False)
    return path, samples


def test_cache_equals_transformers_hidden_states_of_the_same_sequences(checkpoint, cache):
    """Every sample's aux layers and final state equal transformers' (fp32, one sample per forward) to
    within bf16 rounding; almost every element rounds to the same bf16 value."""
    _, hf = checkpoint
    path, samples = cache
    source = CacheDataSource(path, expect={"aux_layer_ids": AUX, "hidden_size": 32})
    assert len(source) == len(samples.input_ids) == 3
    same = total = 0
    for index, ids in enumerate(samples.input_ids):
        record = source[index]
        np.testing.assert_array_equal(record["input_ids"], ids)
        _, layers, final = hf_hybrid.forward(hf, ids[None], np.ones_like(ids)[None])
        want = {"aux_hidden": np.stack([layers[k][0] for k in AUX], axis=1), "last_hidden": final[0]}
        for name, ref in want.items():
            got = record[name].astype(np.float32)
            bound = BF16_STEP * np.abs(ref) + 1e-5 * np.abs(ref).max()
            excess = np.abs(got - ref) - bound
            assert excess.max() <= 0, f"sample {index} {name}: off by {excess.max():.3g} beyond bf16 rounding"
            same += int((record[name] == ref.astype(record[name].dtype)).sum())
            total += ref.size
    assert same / total > 0.99, f"only {same / total:.4f} of the elements round to transformers' bf16 value"


def test_a_smoke_run_trains_on_the_hybrid_cache(checkpoint, cache, tmp_path):
    directory, _ = checkpoint
    path, _ = cache
    config = baseline.get_config("smoke")
    config.target.path = str(directory)
    config.target.random_init = False
    config.data.train_cache = config.data.val_cache = path
    config.data.aux_layer_ids = AUX
    config.mesh.fsdp = 1
    config.train.total_steps = config.train.stop_step = 6
    config.train.eval_every = 0
    last = train(config, tmp_path)
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert np.isfinite(last["train/loss"]) and np.isfinite(last["eval/loss"]), last
    assert summary["steps_computed"] == 6, summary
