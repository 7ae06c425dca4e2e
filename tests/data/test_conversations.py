"""Conversation sources: the ShareGPT package, JSON/JSONL formats, normalisation rules and skips."""

import itertools
import json
import logging

import pytest

from dspark_jax.data import conversations as conv
from dspark_jax.data.conversations import (
    GSM8K_VAL256,
    InvalidConversation,
    first_turns,
    load_conversations,
    normalize_conversation,
    read_turns_jsonl,
    system_prompt,
    user_turns,
)

SHAREGPT_RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    {"id": "b", "conversations": []},
    {
        "id": "c",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "One?"},
            {"from": "chatgpt", "value": "1"},
            {"from": "user", "value": "Two?"},
        ],
    },
    {"id": "d", "conversations": [{"from": "human", "value": "x"}, {"from": "human", "value": "y"}]},
    {"id": "e", "conversations": [{"from": "human", "value": 'Weird {"[ chars ]"}, \u00e9'}]},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_normalize_maps_roles_and_drops_leading_assistant():
    messages = [
        {"from": "gpt", "value": "Hi, how can I help?"},
        {"from": "human", "value": "Q"},
        {"from": "bard", "value": "A"},
        {"role": "user", "content": "Q2"},
    ]
    assert normalize_conversation(messages) == [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q2"},
    ]
    with_system = normalize_conversation(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    )
    assert system_prompt(with_system) == "S"
    assert user_turns(with_system) == ["Q"]
    assert system_prompt(normalize_conversation(messages)) is None


def test_first_turns_keeps_the_first_user_turns_and_their_replies():
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "Q3"},
    ]
    assert first_turns(conversation, 1) == conversation[:3]
    assert first_turns(conversation, 2) == conversation[:5]
    assert first_turns(conversation, 3) == first_turns(conversation, 64) == conversation
    assert user_turns(first_turns(conversation, 1)) == ["Q1"]


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([], "no messages"),
        ("text", "no messages"),
        (["text"], "message not an object"),
        ([{"from": "robot", "value": "x"}], "unknown role"),
        ([{"from": "human", "value": "  "}], "empty content"),
        ([{"from": "human", "value": 3}], "empty content"),
        ([{"from": "human", "value": "q"}, {"from": "system", "value": "s"}], "system message not first"),
        ([{"from": "human", "value": "q"}, {"from": "human", "value": "r"}], "consecutive user messages"),
        ([{"from": "gpt", "value": "a"}], "no user message"),
        (
            [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "gpt", "value": "b"}],
            "consecutive assistant messages",
        ),
    ],
)
def test_normalize_rejects(messages, reason):
    with pytest.raises(InvalidConversation) as e:
        normalize_conversation(messages)
    assert e.value.reason == reason


def test_sharegpt_json_array_counts_and_logs_skips(tmp_path, caplog):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(SHAREGPT_RECORDS, indent=2), encoding="utf-8")
    with caplog.at_level(logging.DEBUG, logger=conv.__name__):
        loaded = load_conversations(path)
    assert [user_turns(c) for c in loaded.conversations] == [
        ["Hi"],
        ["One?", "Two?"],
        [SHAREGPT_RECORDS[4]["conversations"][0]["value"]],
    ]
    assert loaded.conversations[1][0] == {"role": "system", "content": "Be brief."}
    assert dict(loaded.skipped) == {"no messages": 1, "consecutive user messages": 1}
    assert not loaded.truncated
    assert "skipped record 1: no messages" in caplog.text
    assert "skipped record 3: consecutive user messages (messages 0 and 1)" in caplog.text


def test_json_array_reader_stops_at_the_first_incomplete_record(tmp_path):
    text = json.dumps(SHAREGPT_RECORDS, indent=1)
    ends = []  # offsets just past each top-level record
    decoder = json.JSONDecoder()
    pos = text.index("{")
    for _ in SHAREGPT_RECORDS:
        _, pos = decoder.raw_decode(text, pos)
        ends.append(pos)
        pos = text.find("{", pos)
    path = tmp_path / "cut.json"
    for cut in range(1, len(text) + 1, 3):
        path.write_text(text[:cut], encoding="utf-8")
        reader = conv._JsonArrayReader(path, chunk_chars=5)
        records = list(reader)
        complete = sum(end <= cut for end in ends)
        assert records == SHAREGPT_RECORDS[:complete], cut
        assert reader.truncated == (cut < len(text)), cut
    path.write_text(text, encoding="utf-8")
    assert list(conv._JsonArrayReader(path, chunk_chars=2)) == SHAREGPT_RECORDS


def test_truncated_json_file_is_a_counted_skip(tmp_path):
    text = json.dumps(SHAREGPT_RECORDS)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"id": "e"') + 5], encoding="utf-8")
    loaded = load_conversations(path)
    assert loaded.truncated
    assert loaded.skipped["truncated"] == 1
    assert len(loaded.conversations) == 2
    assert loaded.num_skipped == 3


def test_openai_messages_jsonl_with_malformed_lines(tmp_path, caplog):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    path.write_text(
        json.dumps(good) + "\n\n{not json\n" + json.dumps({"other": 1}) + "\n" + json.dumps(good) + "\n",
        encoding="utf-8",
    )
    with caplog.at_level(logging.DEBUG, logger=conv.__name__):
        loaded = load_conversations(path)
    assert len(loaded.conversations) == 2
    assert loaded.conversations[0] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert dict(loaded.skipped) == {"not valid JSON": 1, "no 'conversations' or 'messages' list": 1}
    assert "skipped record 2: not valid JSON" in caplog.text


def test_sharegpt_jsonl_detected_by_content_and_limit(tmp_path):
    path = write_jsonl(tmp_path / "data.json", SHAREGPT_RECORDS)  # JSONL despite the extension
    assert len(load_conversations(path).conversations) == 3
    limited = load_conversations(path, limit=2)
    assert [user_turns(c) for c in limited.conversations] == [["Hi"], ["One?", "Two?"]]
    assert limited.num_skipped == 1


def test_turns_jsonl_is_strict(tmp_path):
    path = write_jsonl(tmp_path / "turns.jsonl", [{"turns": ["a", "b"]}, {"turns": ["c"]}])
    loaded = load_conversations(path)
    assert loaded.conversations[0] == [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert user_turns(loaded.conversations[1]) == ["c"]
    assert len(load_conversations(path, limit=1).conversations) == 1
    write_jsonl(path, [{"turns": ["a"]}, {"turns": []}])
    with pytest.raises(ValueError, match=r"turns.jsonl:2: expected an object with a non-empty 'turns' list"):
        load_conversations(path)


def test_gsm8k_prompts_still_load():
    assert len(read_turns_jsonl(GSM8K_VAL256)) == 256
    assert len(load_conversations(GSM8K_VAL256).conversations) == 256


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_conversations(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="limit"):
        load_conversations(GSM8K_VAL256, limit=0)
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match="no usable conversations"):
        load_conversations(path)
    (tmp_path / "obj.json").write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="no usable"):
        load_conversations(tmp_path / "obj.json")


def test_sharegpt_package():
    full = load_conversations(conv.SHAREGPT)
    assert len(full.conversations) > 17000
    assert full.truncated and full.skipped["truncated"] == 1
    assert len(full.conversations) + full.num_skipped > 17600  # complete records, plus the cut one
    limited = load_conversations("sharegpt", limit=50)
    assert limited.conversations == full.conversations[:50]
    assert not limited.truncated
    for conversation in full.conversations:
        roles = [m["role"] for m in conversation if m["role"] != "system"]
        assert roles[0] == "user"
        assert all(a != b for a, b in itertools.pairwise(roles))


def test_packaged_prompt_files_are_disjoint_and_load_by_name():
    """The split `dspark_jax/data/README.md` and docs/data.md state: GSM8K test questions 1-256 validate,
    257-1,319 may train; MT-Bench is in neither."""
    files = {name: read_turns_jsonl(path) for name, path in conv.PACKAGED_SOURCES.items()}
    assert {name: len(turns) for name, turns in files.items()} == {
        "gsm8k_val256": 256,
        "gsm8k_rest": 1063,
        "mt_bench": 80,
    }
    prompts = {name: {t[0] for t in turns} for name, turns in files.items()}
    assert len(prompts["gsm8k_rest"]) == 1063
    assert not prompts["gsm8k_val256"] & prompts["gsm8k_rest"]
    assert not prompts["mt_bench"] & (prompts["gsm8k_val256"] | prompts["gsm8k_rest"])
    assert all(len(t) == 2 for t in files["mt_bench"])
    loaded = load_conversations("gsm8k_rest", limit=3).conversations
    assert [c[0]["content"] for c in loaded] == [t[0] for t in files["gsm8k_rest"][:3]]


def test_a_blend_takes_each_sources_share_interleaved_evenly(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"turns": [f"a{i}"]} for i in range(20)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"turns": [f"b{i}"]} for i in range(20)])
    assert conv.blend_counts([("a", 3.0), ("b", 1.0)], 10) == [8, 2]  # 7.5 / 2.5: ties to the first
    assert conv.blend_counts([("a", 1.0), ("b", 1.0), ("c", 1.0)], 10) == [4, 3, 3]
    blend = load_conversations(f"{a}=3,{b}=1", limit=8).conversations
    assert [c[0]["content"] for c in blend] == ["a0", "a1", "b0", "a2", "a3", "a4", "b1", "a5"]
    assert [c[0]["content"] for c in load_conversations(f"{a}=1,{b}=1", limit=4).conversations] == [
        "a0",
        "b0",
        "a1",
        "b1",
    ]


@pytest.mark.parametrize(
    "spec, limit, message",
    [
        ("{a}=3,{b}=x", 4, r"blend item '.*b.jsonl=x' .* positive weight"),
        ("{a}=0,{b}=1", 4, r"blend item '.*a.jsonl=0'"),
        ("{a}=1,{b}=1", None, r"needs a number of conversations: set data.train_limit > 0"),
        (
            "{a}=1,{b}=1",
            50,
            r"part '.*b.jsonl' holds 20 usable conversations, the blend .* asks 25 of its 50",
        ),
    ],
)
def test_blend_errors_name_the_part_and_the_fix(tmp_path, spec, limit, message):
    a = write_jsonl(tmp_path / "a.jsonl", [{"turns": [f"a{i}"]} for i in range(30)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"turns": [f"b{i}"]} for i in range(20)])
    with pytest.raises(ValueError, match=message):
        load_conversations(spec.format(a=a, b=b), limit=limit)


def test_absolute_source_resolves_the_files_a_source_names_and_keeps_names_and_weights():
    resolve = lambda path: f"/abs/{path}"
    assert conv.absolute_source("sharegpt", resolve) == "sharegpt"
    assert conv.absolute_source("mt_bench", resolve) == "mt_bench"
    assert conv.absolute_source("", resolve) == ""
    assert conv.absolute_source("mine.jsonl", resolve) == "/abs/mine.jsonl"
    assert conv.absolute_source("sharegpt=3,mine.jsonl=0.5", resolve) == "sharegpt=3,/abs/mine.jsonl=0.5"
