"""Pure-Python byte-level BPE tokenizer (GPT-2 style), loaded from GGUF metadata or a `tokenizer.json`.

Produces the same ids as the Hugging Face `tokenizers` pipeline that transformers builds for the same
file: added tokens (e.g. `<|im_start|>`) are cut out first, the rest is split by the pre-tokenizer
regexes ("isolated" splits), each piece is mapped to the byte-level alphabet and merged by BPE rank.
`encode` never adds BOS/EOS: chat templates write those themselves.

GGUF pre-tokenizer names follow transformers' GGUF conversion (`integrations/gguf/gguf_tokenizer_mapping.py`),
not llama.cpp: names transformers has no split regex for ('gpt2', 'default', 'smollm') fall back to the
plain GPT-2 `ByteLevel` regex, although llama.cpp (and SmolLM2's own `tokenizer.json`) also isolate
every digit for 'smollm'. The two only differ on a whitespace run followed by a digit ("a  1").
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import json
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf
import regex

from dspark_jax.target.gguf_io import open_gguf, read_metadata

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regexes, as transformers converts them.
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "smollm"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_QWEN2_SPLIT,)),
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
_CACHE_LIMIT = 1 << 20


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the byte-level alphabet)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}


_BYTE_CHARS = _bytes_to_unicode()
_CHAR_BYTES = {c: b for b, c in _BYTE_CHARS.items()}
_LATIN1_TO_BYTE_LEVEL = str.maketrans({chr(b): c for b, c in _BYTE_CHARS.items()})


def _to_byte_level(text: str) -> str:
    return text.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_LEVEL)


def _in_alphabet(token: str) -> bool:
    return all(c in _CHAR_BYTES for c in token)


def _token_bytes(token: str) -> bytes:
    """Bytes a token decodes to: byte-level spelling when every character is in the alphabet, else UTF-8."""
    if _in_alphabet(token):
        return bytes(_CHAR_BYTES[c] for c in token)
    return token.encode("utf-8")


@dataclasses.dataclass(frozen=True)
class AddedToken:
    """A token matched whole in the raw text before pre-tokenization (`special` ones are control tokens)."""

    content: str
    id: int
    special: bool


class Tokenizer:
    """Byte-level BPE tokenizer.

    Args:
      vocab: byte-level token string -> id (the BPE model's vocabulary).
      merges: BPE merges, best (lowest rank) first.
      added_tokens: tokens matched literally in the text (leftmost, longest first).
      pre_split: regexes applied in order, each splitting every piece into matches and the gaps between.
      normalizer: None or 'NFC', applied to the text between added tokens.
      ignore_merges: look a whole pre-token up in the vocabulary before merging (Llama 3 `tokenizer.json`).
      bos_id, eos_id, pad_id: special ids (each may be None); `pad_id` falls back to `eos_id`.
      chat_template: the Jinja chat template shipped with the tokenizer, if any.
    """

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        added_tokens: Sequence[AddedToken] = (),
        *,
        pre_split: Sequence[str] = (_GPT2_SPLIT,),
        normalizer: str | None = None,
        ignore_merges: bool = False,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        if normalizer not in (None, "NFC"):
            raise ValueError(f"unsupported normalizer {normalizer!r} (supported: None, 'NFC')")
        self._vocab = dict(vocab)
        self._merge_list = [tuple(m) for m in merges]
        self._added = sorted(added_tokens, key=lambda t: t.id)
        self._pre_split = tuple(pre_split)
        self._patterns = [regex.compile(p) for p in self._pre_split]
        self._normalizer = normalizer
        self._ignore_merges = ignore_merges
        self._merges: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self._merge_list):
            try:
                pair, merged = (vocab[a], vocab[b]), vocab[a + b]
            except KeyError:
                raise ValueError(f"merge {a!r} {b!r} uses a token missing from the vocabulary") from None
            self._merges[pair] = (rank, merged)  # A repeated merge keeps its last rank, as in HF.
        self._id_to_token = {i: t for t, i in self._vocab.items()}
        self._id_to_token.update({t.id: t.content for t in self._added})
        self._token_to_id = {**self._vocab, **{t.content: t.id for t in self._added}}
        self._vocab_size = max(self._id_to_token) + 1
        self._id_bytes = [_token_bytes(self._id_to_token.get(i, "")) for i in range(self._vocab_size)]
        self._byte_ids = [vocab.get(_BYTE_CHARS[b]) for b in range(256)]
        self._added_re = _alternation(self._added)
        self._user_re = _alternation([t for t in self._added if not t.special])
        self._bos_id, self._eos_id = bos_id, eos_id
        self._pad_id = pad_id if pad_id is not None else eos_id
        self._special_ids = frozenset(
            {t.id for t in self._added if t.special} | {i for i in (bos_id, eos_id, pad_id) if i is not None}
        )
        self._chat_template = chat_template
        self._cache: dict[str, tuple[int, ...]] = {}
        self._fingerprint: str | None = None

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | gguf.GGUFReader) -> Tokenizer:
        """Builds the tokenizer a GGUF file describes (`tokenizer.ggml.model == 'gpt2'` only)."""
        if isinstance(path_or_reader, gguf.GGUFReader):
            reader, name = path_or_reader, str(getattr(path_or_reader.data, "filename", "<GGUF reader>"))
        else:
            reader, name = open_gguf(path_or_reader), str(path_or_reader)
        meta = read_metadata(reader)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{name}: tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')"
            )
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(
                f"{name}: unknown pre-tokenizer {pre!r}; supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # As transformers does: tokens spelled outside the byte-level alphabet are re-spelled into it.
        vocab = {t if _in_alphabet(t) else _to_byte_level(t): i for i, t in enumerate(tokens)}
        added = [
            AddedToken(t, i, special=ty == _GGUF_CONTROL)
            for i, (t, ty) in enumerate(zip(tokens, types))
            if (ty == _GGUF_CONTROL and _in_alphabet(t)) or (ty == _GGUF_USER_DEFINED and t in vocab)
        ]
        merges = []
        for m in meta.get("tokenizer.ggml.merges", []):
            a, sep, b = m.partition(" ")
            if not sep or " " in b:
                raise ValueError(f"{name}: malformed merge {m!r}")
            merges.append((a, b))
        return cls(
            vocab,
            merges,
            added,
            pre_split=GGUF_PRE_TOKENIZERS[pre],
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> Tokenizer:
        """Loads a Hugging Face `tokenizer.json` (BPE + ByteLevel); reads `tokenizer_config.json` and
        `chat_template.jinja` beside it, when present, for the chat template and BOS/EOS/PAD tokens."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"{path}: tokenizer model {model.get('type')!r} is not supported (only 'BPE')")
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        if any(len(m) != 2 for m in merges):
            raise ValueError(f"{path}: malformed merges")
        added = [
            AddedToken(t["content"], t["id"], bool(t.get("special"))) for t in spec.get("added_tokens", [])
        ]
        normalizer = spec.get("normalizer")
        if normalizer is not None:
            kinds = [n["type"] for n in normalizer.get("normalizers", [normalizer])] or [None]
            if kinds not in ([None], ["NFC"]):
                raise ValueError(f"{path}: unsupported normalizer {kinds} (supported: none, NFC)")
            normalizer = kinds[0]
        config = path.with_name("tokenizer_config.json")
        config = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        template_file = path.with_name("chat_template.jinja")
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        template = template or config.get("chat_template")
        if isinstance(template, list):  # Named templates: [{"name": ..., "template": ...}].
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        ids = {t.content: t.id for t in added} | model.get("vocab", {})

        def special_id(key: str) -> int | None:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return ids.get(token) if token is not None else None

        return cls(
            model.get("vocab", {}),
            merges,
            added,
            pre_split=_json_pre_split(spec.get("pre_tokenizer"), path),
            normalizer=normalizer,
            ignore_merges=bool(model.get("ignore_merges")),
            bos_id=special_id("bos_token"),
            eos_id=special_id("eos_token"),
            pad_id=special_id("pad_token"),
            chat_template=template,
        )

    def _segments(self, text: str, allow_special: bool) -> Iterator[tuple[int, str, int | None]]:
        """Yields `(char_start, piece, added_token_id_or_None)`, cutting out added tokens."""
        pattern = self._added_re if allow_special else self._user_re
        last = 0
        if pattern is not None:
            for m in pattern.finditer(text):
                if m.start() > last:
                    yield last, text[last : m.start()], None
                yield m.start(), m.group(), self._token_to_id[m.group()]
                last = m.end()
        if last < len(text):
            yield last, text[last:], None

    def _words(self, text: str) -> list[tuple[int, str]]:
        """Pre-tokenizes `text` into `(char_start, word)` pieces."""
        pieces = [(0, text)]
        for pattern in self._patterns:
            out = []
            for base, piece in pieces:
                last = 0
                for m in pattern.finditer(piece):
                    start, end = m.span()
                    if start > last:
                        out.append((base + last, piece[last:start]))
                    if end > start:
                        out.append((base + start, piece[start:end]))
                    last = end
                if last < len(piece):
                    out.append((base + last, piece[last:]))
            pieces = out
        return pieces

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-token (cached). Merges like HF's BPE: always the lowest-rank pair, leftmost on
        ties, in O(n log n) with a heap over a linked list of symbols."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ids: list[int | None]
        if self._ignore_merges and (whole := self._vocab.get(_to_byte_level(word))) is not None:
            ids = [whole]
        else:  # One symbol per UTF-8 byte; bytes without a token are dropped, as HF's BPE does without unk.
            ids = [i for i in map(self._byte_ids.__getitem__, word.encode()) if i is not None]
        merges, n = self._merges, len(ids)
        heap = [(*merges[pair], i) for i, pair in enumerate(itertools.pairwise(ids)) if pair in merges]
        heapq.heapify(heap)
        nxt, prv = [*range(1, n), -1], list(range(-1, n - 1))
        while heap:
            _, new, pos = heapq.heappop(heap)
            right = nxt[pos]
            if ids[pos] is None or right < 0 or merges.get((ids[pos], ids[right]), (0, -1))[1] != new:
                continue  # Stale entry: one of the two symbols was merged away since it was pushed.
            ids[pos], ids[right] = new, None
            after = nxt[pos] = nxt[right]
            if after >= 0:
                prv[after] = pos
                if (found := merges.get((new, ids[after]))) is not None:
                    heapq.heappush(heap, (*found, pos))
            if (before := prv[pos]) >= 0 and (found := merges.get((ids[before], new))) is not None:
                heapq.heappush(heap, (*found, before))
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        result = self._cache[word] = tuple(i for i in ids if i is not None)
        return result

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS/EOS added). With `allow_special`, control tokens written in the text
        (e.g. `<|im_start|>`) become their ids; otherwise only non-special added tokens are matched."""
        ids: list[int] = []
        for _, piece, added_id in self._segments(text, allow_special):
            if added_id is not None:
                ids.append(added_id)
                continue
            if self._normalizer:
                piece = unicodedata.normalize(self._normalizer, piece)
            for _, word in self._words(piece):
                ids.extend(self._bpe(word))
        return ids

    def encode_with_offsets(
        self, text: str, *, allow_special: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` plus each token's `[start, end)` character span in `text`.

        A token holding part of a multi-byte character spans that whole character. When the normalizer
        changes a piece between added tokens, every token of that piece gets the piece's whole span.
        """
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for seg_start, piece, added_id in self._segments(text, allow_special):
            if added_id is not None:
                ids.append(added_id)
                offsets.append((seg_start, seg_start + len(piece)))
                continue
            normalized = unicodedata.normalize(self._normalizer, piece) if self._normalizer else piece
            for start, word in self._words(normalized):
                word_ids = self._bpe(word)
                ids.extend(word_ids)
                if normalized != piece:
                    offsets.extend([(seg_start, seg_start + len(piece))] * len(word_ids))
                else:
                    offsets.extend(self._word_offsets(seg_start + start, word, word_ids))
        return ids, offsets

    def _word_offsets(self, start: int, word: str, ids: Sequence[int]) -> list[tuple[int, int]]:
        lengths = [len(self._id_bytes[i]) for i in ids]
        if word.isascii() and sum(lengths) == len(word):
            ends = list(itertools.accumulate(lengths, initial=start))
            return list(itertools.pairwise(ends))
        data = word.encode("utf-8")
        char_of_byte = [ci for ci, c in enumerate(word) for _ in range(len(c.encode("utf-8")))]
        out, pos = [], 0
        for length in lengths:
            while self._byte_ids[data[pos]] is None:  # Skip bytes the vocabulary drops.
                pos += 1
            out.append((start + char_of_byte[pos], start + char_of_byte[pos + length - 1] + 1))
            pos += length
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a split multi-byte character) becomes U+FFFD, as in HF."""
        parts = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self._vocab_size})")
            if not (skip_special_tokens and i in self._special_ids):
                parts.append(self._id_bytes[i])
        return b"".join(parts).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        """Number of ids (one past the largest id, added tokens included)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        """Padding id: the file's pad token, else the EOS id."""
        return self._pad_id

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of control added tokens plus BOS/EOS/PAD (dropped by `decode(skip_special_tokens=True)`)."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str) -> int:
        """Id of a token string (byte-level spelling, or an added token's content); KeyError if unknown."""
        return self._token_to_id[token]

    def id_to_token(self, token_id: int) -> str:
        """Token string of an id (byte-level spelling, or an added token's content); KeyError if unknown."""
        return self._id_to_token[token_id]

    def fingerprint(self) -> str:
        """SHA-256 hex digest of everything that determines ids: vocabulary, merges, added tokens,
        pre-tokenizer regexes, normalizer. Stable across processes."""
        if self._fingerprint is None:
            payload: dict[str, Any] = {
                "vocab": sorted(self._vocab.items(), key=lambda kv: (kv[1], kv[0])),
                "merges": [" ".join(m) for m in self._merge_list],
                "added": [[t.id, t.content, t.special] for t in self._added],
                "pre_split": list(self._pre_split),
                "normalizer": self._normalizer,
                "ignore_merges": self._ignore_merges,
            }
            blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            self._fingerprint = hashlib.sha256(blob).hexdigest()
        return self._fingerprint


def _alternation(tokens: Sequence[AddedToken]) -> regex.Pattern | None:
    """Regex matching any of `tokens` literally, longest first (HF matches added tokens leftmost-longest)."""
    contents = sorted({t.content for t in tokens}, key=lambda s: (-len(s), s))
    return regex.compile("|".join(map(regex.escape, contents))) if contents else None


def _json_pre_split(pre: dict[str, Any] | None, path: Path) -> tuple[str, ...]:
    """Split regexes equivalent to a `tokenizer.json` pre-tokenizer (Split / Digits / ByteLevel steps)."""
    if pre is None:
        steps = []
    elif pre.get("type") == "Sequence":
        steps = pre["pretokenizers"]
    else:
        steps = [pre]
    out: list[str] = []
    byte_level = False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise ValueError(f"{path}: ByteLevel add_prefix_space=True is not supported")
            if step.get("use_regex", True):
                out.append(_GPT2_SPLIT)
            byte_level = True
        elif kind == "Digits":
            out.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
        elif kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
            pattern = step["pattern"]
            out.append(pattern["Regex"] if "Regex" in pattern else regex.escape(pattern["String"]))
        else:
            raise ValueError(f"{path}: unsupported pre-tokenizer step {step}")
    if not byte_level:
        raise ValueError(f"{path}: not a byte-level tokenizer (no ByteLevel pre-tokenizer)")
    return tuple(out)
