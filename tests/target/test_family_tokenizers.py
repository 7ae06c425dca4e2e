"""Each target family's tokenizer and chat template against Hugging Face, on a large corpus.

For every family of `tokenizer_families.py` (SmolLM2's real tokenizer; BPEs built through transformers'
Qwen2 and Qwen 3.5 tokenizer classes), `Tokenizer.from_tokenizer_json` gives HF `tokenizers`' ids on 3,000
ShareGPT texts and on held-out texts with combining marks, and decodes like it. For the Qwen families, the
shipped chat template renders like transformers' `apply_chat_template` and the loss mask of
`tokenize_conversation` covers exactly the assistant replies.
"""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest

from dspark_jax.target.chat import ChatTemplate, tokenize_conversation
from dspark_jax.target.tokenizer import Tokenizer
from tests.references import reference
from tests.target.tokenizer_families import FAMILIES, TEST_TEXTS, build, sharegpt_corpus

transformers = reference("transformers")
tokenizers = reference("tokenizers")

QWEN_FAMILIES = ("qwen3", "qwen3_5")
SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another one, ünïcödé 😀?"},
    {"role": "assistant", "content": " 11 \n"},
]
REASONED = [
    *TURNS,
    {"role": "user", "content": "Why is it prime?"},
    {"role": "assistant", "content": "No divisors.", "reasoning_content": "11 = 1 x 11 only."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CALLS = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "Paris sunny, Rome rain.", "reasoning": "Two tool results."},
]
CONVERSATIONS = {
    "prompt_only": TURNS[:1],
    "single_turn": TURNS[:2],
    "system_multi_turn": [SYSTEM, *TURNS],
    "reasoning": [SYSTEM, *REASONED],
    "think_in_content": [TURNS[0], {"role": "assistant", "content": "<think>\nsmall\n</think>\n\n2"}],
    "tool_calls": TOOL_CALLS,
}
PROMPTS = {
    "no_prompt": {"add_generation_prompt": False},
    "prompt": {"add_generation_prompt": True},
    "prompt_no_thinking": {"add_generation_prompt": True, "enable_thinking": False},
}


@pytest.fixture(scope="module")
def corpus():
    return sharegpt_corpus()


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory, corpus):
    """family -> its `tokenizer.json`, built once per module."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build(family, tmp_path_factory.mktemp(family), corpus.train)
        return built[family]

    return get


def _pair(path):
    """The project's tokenizer and HF `tokenizers`' of one `tokenizer.json`."""
    return Tokenizer.from_tokenizer_json(path), tokenizers.Tokenizer.from_file(str(path))


def _ids_mismatch(mine: Tokenizer, ref, texts: list[str]) -> str:
    """'' when the project's ids equal `tokenizers`' on every text, else the count and first difference."""
    bad = []
    for index, text in enumerate(texts):
        ours, theirs = mine.encode(text), ref.encode(text, add_special_tokens=False).ids
        if ours != theirs:
            bad.append((index, text, ours, theirs))
    if not bad:
        return ""
    index, text, ours, theirs = bad[0]
    at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (
        f"{len(bad)} of {len(texts)} texts differ; first, text {index} {text[:400]!r}: from token {at}, "
        f"ours {ours[at : at + 8]} vs tokenizers {theirs[at : at + 8]}"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_match_tokenizers_on_sharegpt(tokenizer_json, corpus, family):
    assert len(corpus.test) == TEST_TEXTS
    mismatch = _ids_mismatch(*_pair(tokenizer_json(family)), corpus.test)
    assert not mismatch, mismatch


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_match_tokenizers_on_decomposed_sharegpt(tokenizer_json, corpus, family):
    """The test texts that NFD changes, decomposed (accents, Hangul): what an NFC normalizer recomposes."""
    decomposed = [d for t in corpus.test if (d := unicodedata.normalize("NFD", t)) != t]
    assert len(decomposed) >= 50
    mismatch = _ids_mismatch(*_pair(tokenizer_json(family)), decomposed)
    assert not mismatch, mismatch


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_round_trip_on_sharegpt(tokenizer_json, corpus, family):
    mine, ref = _pair(tokenizer_json(family))
    for index, text in enumerate(corpus.test):
        ids = ref.encode(text, add_special_tokens=False).ids
        normalized = ref.normalizer.normalize_str(text) if ref.normalizer else text
        decoded = mine.decode(ids)
        assert decoded == ref.decode(ids, skip_special_tokens=False) == normalized, (
            f"text {index} {text[:400]!r}"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_match_tokenizers_on_combining_marks(tokenizer_json, corpus, family):
    assert len(corpus.marks) >= 10
    mismatch = _ids_mismatch(*_pair(tokenizer_json(family)), corpus.marks)
    assert not mismatch, mismatch


def test_qwen3_5_split_keeps_marks_in_words(tokenizer_json, corpus, tmp_path):
    """The held-out mark texts tell Qwen 3.5's split regex from Qwen 2's: the Qwen 3.5 file read with Qwen 2's
    regex instead gives other ids than `tokenizers` on some of them (so the test above would notice)."""
    spec = json.loads(tokenizer_json("qwen3_5").read_text(encoding="utf-8"))
    qwen2 = json.loads(tokenizer_json("qwen3").read_text(encoding="utf-8"))["pre_tokenizer"]
    assert spec["pre_tokenizer"] != qwen2 and r"\p{M}" in json.dumps(spec["pre_tokenizer"])
    ref = tokenizers.Tokenizer.from_str(json.dumps(spec))
    swapped = tmp_path / "tokenizer.json"
    swapped.write_text(json.dumps({**spec, "pre_tokenizer": qwen2}), encoding="utf-8")
    assert _ids_mismatch(Tokenizer.from_tokenizer_json(swapped), ref, corpus.marks)


@pytest.mark.parametrize("family", FAMILIES)
def test_added_tokens_match_tokenizers(tokenizer_json, family):
    path = tokenizer_json(family)
    mine, ref = _pair(path)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent)
    text = (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm</think>\n\n"
        "<tool_call>\n{}</tool_call><|im_end|>x<|endoftext|><|image_pad|>"
    )
    ids = ref.encode(text, add_special_tokens=False).ids
    assert mine.encode(text) == ids
    for skip in (False, True):
        assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    ref.encode_special_tokens = True
    assert mine.encode(text, allow_special=False) == ref.encode(text, add_special_tokens=False).ids
    assert (mine.bos_id, mine.eos_id, mine.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert mine.vocab_size == len(hf) and mine.chat_template == hf.chat_template


@pytest.fixture(scope="module")
def qwen(tokenizer_json):
    """family -> (project tokenizer, its chat template, transformers' tokenizer) of the Qwen families."""

    def get(family: str):
        path = tokenizer_json(family)
        tok = Tokenizer.from_tokenizer_json(path)
        return tok, ChatTemplate.for_tokenizer(tok), transformers.AutoTokenizer.from_pretrained(path.parent)

    return get


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_render_matches_transformers(qwen, family, name, prompt):
    tok, template, hf = qwen(family)
    messages, kwargs = CONVERSATIONS[name], PROMPTS[prompt]
    tools = TOOLS if name == "tool_calls" else None
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    text = template.render(messages, tools=tools, **kwargs)
    assert text == expected
    expected_ids = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, **kwargs)
    assert tok.encode(text) == list(expected_ids["input_ids"])


def _masked_runs(tok: Tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tok.decode(ids[start:end]) for start, end in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_loss_mask_covers_the_replies(qwen, family):
    tok, template, _ = qwen(family)
    messages = [SYSTEM, *REASONED]
    ids, mask = tokenize_conversation(tok, template, messages)
    assert ids.tolist() == tok.encode(template.render(messages))
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert _masked_runs(tok, ids, mask) == replies
    unmasked = tok.decode(ids[mask == 0])
    assert unmasked.count("<|im_start|>assistant\n") == 3 and "You are terse." in unmasked
    assert "<think>\n11 = 1 x 11 only.\n</think>" in unmasked  # Reasoning is not a reply.


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_loss_mask_skips_a_user_turn_repeating_the_reply(qwen, family):
    """A reply also written in the user turn before it is masked where the assistant says it, even when the
    generation prompt (`<think>` opened) is not how the template writes that earlier turn."""
    tok, template, _ = qwen(family)
    messages = [
        {"role": "user", "content": "Answer 42"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "42"},
    ]
    ids, mask = tokenize_conversation(tok, template, messages)
    assert _masked_runs(tok, ids, mask) == ["42<|im_end|>", "42<|im_end|>"]
    assert "Answer 42<|im_end|>" in tok.decode(ids[mask == 0])
