"""Conversation sources: `{"turns": [...]}` JSONL prompts and the packaged GSM8K validation prompts."""

from __future__ import annotations

import json
from pathlib import Path

GSM8K_VAL256 = Path(__file__).resolve().parent / "gsm8k_val256.jsonl"


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
