"""Chat templates (Jinja, rendered as transformers' `apply_chat_template`) and conversation tokenization.

`tokenize_conversation` turns a conversation into `(ids, loss_mask)` for training: the mask selects the
tokens of every assistant message's content plus the end-of-turn token the template writes right after
it (e.g. `<|im_end|>`), and nothing else (system/user turns, role headers, separators).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dspark_jax.target.tokenizer import Tokenizer

Message = Mapping[str, Any]
# Names a message's reasoning may come under; transformers copies it to all of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # Jinja's own `tojson` escapes HTML characters; transformers overrides it with plain `json.dumps`.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to the template: keys whose value is None dropped, reasoning
    aliased to `thinking` and `reasoning_content`."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A Jinja chat template, rendered exactly like transformers' `apply_chat_template(tokenize=False)`."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(template)

    def __reduce__(self):  # Picklable (for data-loader workers): recompiled from the source.
        return ChatTemplate, (self.source, self.bos_token, self.eos_token)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """The template shipped with `tokenizer`, with its BOS/EOS token strings."""
        if not tokenizer.chat_template:
            raise ValueError(
                "the tokenizer has no chat template (no `tokenizer.chat_template` / `chat_template`)"
            )

        def token(token_id: int | None) -> str:
            return tokenizer.id_to_token(token_id) if token_id is not None else ""

        return cls(tokenizer.chat_template, token(tokenizer.bos_id), token(tokenizer.eos_id))

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as text. `add_generation_prompt` appends the assistant header to generate after;
        `tools` (JSON schemas) and `documents` reach the template as in transformers; `kwargs` are extra
        template variables (e.g. `enable_thinking=False`)."""
        return self._template.render(
            messages=_template_messages(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs},
        )


def _validate(messages: Sequence[Message]) -> None:
    if not messages:
        raise ValueError("empty conversation")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} is not a dict: {message!r}")
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} needs a string 'role' and a string 'content': {message!r}")


def _prompt_end(template: ChatTemplate, head: Sequence[Message], text: str) -> int:
    """Length of `head` rendered with a generation prompt, else without one, where that is a prefix of
    `text`; 0 when neither is (or the template refuses `head`)."""
    for generation_prompt in (True, False):
        try:
            prompt = template.render(head, add_generation_prompt=generation_prompt)
        except jinja2.TemplateError:
            continue
        if text.startswith(prompt):
            return len(prompt)
    return 0


def _assistant_spans(
    tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[Message], text: str
) -> list[tuple[int, int]]:
    """`[start, end)` character spans in `text` (the rendered conversation) of each assistant message's
    content plus the special token immediately after it.

    Each content is searched from the end of the rendered prompt before it: the conversation up to that
    message with a generation prompt when that is a prefix of `text`, else without one (a template whose
    generation prompt opens a `<think>` block that earlier turns do not keep), so a user turn repeating the
    answer is never mistaken for it. A template that trims the content is handled; one that rewrites it
    raises.
    """
    specials = sorted((tokenizer.id_to_token(i) for i in tokenizer.special_ids), key=len, reverse=True)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i > 0:
            cursor = max(cursor, _prompt_end(template, messages[:i], text))
        content = message["content"]
        start = text.find(content, cursor)
        if start < 0:
            content = content.strip()
            start = text.find(content, cursor)
        if start < 0:
            raise ValueError(f"assistant message {i}: content not found in the rendered conversation")
        end = start + len(content)
        end += next((len(s) for s in specials if text.startswith(s, end)), 0)
        if end > start:
            spans.append((start, end))
        cursor = end
    return spans


def tokenize_conversation(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Message],
    *,
    require_response: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of a rendered conversation (no generation prompt).

    Returns:
      ids: int32[T], equal to `tokenizer.encode(template.render(messages))`.
      loss_mask: uint8[T], 1 on every token overlapping an assistant content + end-of-turn span.

    Raises:
      ValueError: empty conversation, a message without string role/content, no assistant message while
        `require_response`, or an assistant content the template does not reproduce.
    """
    _validate(messages)
    text = template.render(messages, add_generation_prompt=False)
    spans = _assistant_spans(tokenizer, template, messages, text)
    if require_response and not spans:
        raise ValueError("conversation has no assistant message to train on")
    ids, offsets = tokenizer.encode_with_offsets(text)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        mask |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
    return np.asarray(ids, dtype=np.int32), mask.astype(np.uint8)


def prompt_ids(tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[Message]) -> np.ndarray:
    """int32[T] ids of the conversation rendered with the generation prompt (what to generate after)."""
    _validate(messages)
    return np.asarray(tokenizer.encode(template.render(messages, add_generation_prompt=True)), dtype=np.int32)
