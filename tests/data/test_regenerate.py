"""Regeneration with the `:smoke` random target: output format, determinism, kill-resume, contexts."""

import json

import pytest

from configs.base import get_config
from dspark_jax.data import regenerate as regen
from dspark_jax.data.regenerate import (
    NO_USER_TURN,
    PROMPT_TOO_LONG,
    RegenerationReport,
    local_path,
    read_output,
    regenerate,
    remote_path,
    run_file,
    skip_reason,
)
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import prompt_ids
from dspark_jax.target.generate import Generator, SamplingParams
from tests.data.fake_gcs import fake_gcs


def user(text):
    return {"role": "user", "content": text}


CONVERSATIONS = [
    [user("What is 2+2?")],
    [{"role": "system", "content": "You are terse."}, user("Name a colour."), user("Another one?")],
    [user("Hi"), {"role": "assistant", "content": "old reply, discarded"}, user("Tell me a joke.")],
    [user("Count to three.")],
    [user("Why is the sky blue?"), user("And the sea?"), user("Thanks!")],
]
SAMPLED = SamplingParams(temperature=1.0)
SETTINGS = dict(max_new_tokens=8, params=SAMPLED, seed=3, batch_size=2, chunk_size=2, progress=False)


@pytest.fixture(scope="module")
def target(mesh1):
    return target_from_config(get_config("smoke").target, seed=0, mesh=mesh1)


@pytest.fixture(scope="module")
def reference(target, mesh1, tmp_path_factory):
    """An uninterrupted run: (output bytes, report, output path)."""
    path = tmp_path_factory.mktemp("reference") / "out.jsonl"
    report = regenerate(target, CONVERSATIONS, path, mesh=mesh1, **SETTINGS)
    return path.read_bytes(), report, path


def read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class Killed(Exception):
    pass


def kill_after(chunks):
    def on_chunk(done):
        if done >= chunks * SETTINGS["chunk_size"]:
            raise Killed(done)

    return on_chunk


def test_output_format(reference):
    path = reference[2]
    records = read(path)
    assert [r["index"] for r in records] == list(range(len(CONVERSATIONS)))
    for record, source in zip(records, CONVERSATIONS):
        messages = record["messages"]
        system = [m for m in source if m["role"] == "system"]
        assert messages[: len(system)] == system
        turns = messages[len(system) :]
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
        assert [m["content"] for m in turns[::2]] == [m["content"] for m in source if m["role"] == "user"]
        assert all(isinstance(m["content"], str) for m in turns[1::2])
    assert "old reply, discarded" not in reference[0].decode()
    report = reference[1]
    assert (report.done, report.resumed, report.skipped, report.truncated) == (5, 0, 0, 0)
    assert 0 < report.tokens <= 8 * 9
    settings = json.loads(run_file(path).read_text(encoding="utf-8"))
    assert (settings["seed"], settings["chunk_size"], settings["conversations"]) == (3, 2, 5)


def test_deterministic_for_a_seed(target, mesh1, reference, tmp_path):
    again = tmp_path / "again.jsonl"
    regenerate(target, CONVERSATIONS, again, mesh=mesh1, **SETTINGS)
    assert again.read_bytes() == reference[0]
    other = tmp_path / "other.jsonl"
    regenerate(target, CONVERSATIONS, other, mesh=mesh1, **{**SETTINGS, "seed": 4})
    assert other.read_bytes() != reference[0]


def test_kill_and_resume_equals_uninterrupted(target, mesh1, reference, tmp_path):
    path = tmp_path / "out.jsonl"
    with pytest.raises(Killed):
        regenerate(target, CONVERSATIONS, path, mesh=mesh1, on_chunk=kill_after(1), **SETTINGS)
    assert [r["index"] for r in read(path)] == [0, 1]
    # A kill in the middle of writing chunk 2: one whole line of it and a partial one.
    lines = reference[0].splitlines(keepends=True)
    with path.open("ab") as f:
        f.write(lines[2] + lines[3][:17])
    report = regenerate(target, CONVERSATIONS, path, mesh=mesh1, **SETTINGS)
    assert path.read_bytes() == reference[0]
    assert (report.done, report.resumed) == (3, 2)
    finished = regenerate(target, CONVERSATIONS, path, mesh=mesh1, **SETTINGS)
    assert finished == RegenerationReport(0, 5, 0, 0, 0, finished.seconds)
    assert path.read_bytes() == reference[0]


def test_resume_refuses_other_settings_or_foreign_files(target, mesh1, tmp_path):
    path = tmp_path / "out.jsonl"
    with pytest.raises(Killed):
        regenerate(target, CONVERSATIONS, path, mesh=mesh1, on_chunk=kill_after(1), **SETTINGS)
    with pytest.raises(ValueError, match="seed differ"):
        regenerate(target, CONVERSATIONS, path, mesh=mesh1, **{**SETTINGS, "seed": 5})
    with pytest.raises(ValueError, match="conversations, conversations_sha256 differ"):
        regenerate(target, CONVERSATIONS[:4], path, mesh=mesh1, **SETTINGS)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text(lines[1] + lines[0], encoding="utf-8")
    with pytest.raises(ValueError, match=r"out\.jsonl:1: expected the line of conversation 0"):
        regenerate(target, CONVERSATIONS, path, mesh=mesh1, **SETTINGS)
    run_file(path).unlink()
    with pytest.raises(ValueError, match="without its run file"):
        regenerate(target, CONVERSATIONS, path, mesh=mesh1, **SETTINGS)


def test_later_turns_see_the_targets_replies(target, mesh1, tmp_path, monkeypatch):
    prompts = []
    original = Generator.generate

    def spy(self, batch, **kwargs):
        prompts.extend(batch)
        return original(self, batch, **kwargs)

    monkeypatch.setattr(Generator, "generate", spy)
    path = tmp_path / "out.jsonl"
    regenerate(target, CONVERSATIONS, path, mesh=mesh1, **SETTINGS)
    expected = []
    for record in read(path):
        messages = record["messages"]
        for k, message in enumerate(messages):
            if message["role"] == "user":
                expected.append(
                    prompt_ids(target.tokenizer, target.chat_template, messages[: k + 1]).tolist()
                )
    assert sorted(prompts) == sorted(expected)
    second_turn = read(path)[4]["messages"]
    text = target.tokenizer.decode(
        prompt_ids(target.tokenizer, target.chat_template, second_turn[:3]).tolist(),
        skip_special_tokens=False,
    )
    assert second_turn[1]["content"] in text


def test_prompts_over_the_limit_skip_or_truncate(target, mesh1, tmp_path):
    long_turn = "word " * 60
    conversations = [[user(long_turn)], [user("Hi"), user(long_turn)], [user("Hello")]]
    path = tmp_path / "out.jsonl"
    report = regenerate(
        target, conversations, path, mesh=mesh1, **{**SETTINGS, "params": regen.GREEDY}, max_prompt_tokens=40
    )
    records = read(path)
    assert records[0] == {"index": 0, "skipped": records[0]["skipped"]}
    assert "max_prompt_tokens 40" in records[0]["skipped"]
    assert skip_reason(records[0]) == PROMPT_TOO_LONG
    assert len(records[1]["messages"]) == 2 and records[1]["truncated"].startswith("turn 1:")
    assert len(records[2]["messages"]) == 2 and "truncated" not in records[2]
    assert (report.done, report.skipped, report.truncated) == (3, 1, 1)


def test_argument_checks(target, tmp_path):
    with pytest.raises(ValueError, match="chunk_size"):
        regenerate(target, CONVERSATIONS, tmp_path / "o.jsonl", max_new_tokens=8, chunk_size=0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        regenerate(target, CONVERSATIONS, tmp_path / "o.jsonl", max_new_tokens=8, max_prompt_tokens=10**6)


def test_url_output_is_uploaded_and_resumed_from_the_upload(target, mesh1, reference, tmp_path):
    url = "gs://bucket/replies/out.jsonl"
    uploaded = tmp_path / "gcs" / "bucket" / "replies" / "out.jsonl"
    with fake_gcs(tmp_path / "gcs"):
        with pytest.raises(Killed):
            regenerate(
                target,
                CONVERSATIONS,
                url,
                mesh=mesh1,
                staging_dir=tmp_path / "machine1",
                sync_seconds=0,
                on_chunk=kill_after(1),
                **SETTINGS,
            )
        assert [r["index"] for r in read(uploaded)] == [0, 1]
        assert not (tmp_path / "gs:").exists() and not (tmp_path / "machine1" / "gs:").exists()
        # Another machine (an empty staging directory) continues from the upload.
        report = regenerate(
            target, CONVERSATIONS, url, mesh=mesh1, staging_dir=tmp_path / "machine2", **SETTINGS
        )
        assert (report.done, report.resumed) == (3, 2)
        assert uploaded.read_bytes() == reference[0]
        assert run_file(uploaded).read_bytes() == run_file(reference[2]).read_bytes()
        assert read_output(url) == read(reference[2])
        # The first machine's copy is behind the upload: it starts from the upload too, with nothing to do.
        finished = regenerate(
            target, CONVERSATIONS, url, mesh=mesh1, staging_dir=tmp_path / "machine1", **SETTINGS
        )
        assert (finished.done, finished.resumed) == (0, 5)
        assert uploaded.read_bytes() == reference[0]


def test_local_and_remote_paths():
    assert local_path("/tmp/x/out.jsonl") == local_path("file:///tmp/x/out.jsonl")
    assert str(local_path("file:///tmp/a%20b/out.jsonl")) == "/tmp/a b/out.jsonl"
    assert str(local_path("relative/out.jsonl")) == "relative/out.jsonl"
    assert local_path("gs://bucket/out.jsonl") is None
    assert str(remote_path("gs://bucket/x/out.jsonl")) == "gs://bucket/x/out.jsonl"
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        remote_path("memory://x/out.jsonl")
    assert skip_reason({"index": 0, "skipped": "no user turn"}) == NO_USER_TURN


def test_interleaved_replies_are_refused(tmp_path):
    """Two writers appending to one replies file leave indices 0, 1, 0, 1: reading it is a clear error."""
    from dspark_jax.data.regenerate import read_output

    path = tmp_path / "replies.jsonl"
    path.write_text("".join(json.dumps({"index": i, "messages": []}) + "\n" for i in (0, 1, 0, 1)))
    with pytest.raises(
        ValueError, match=r"replies.jsonl:3: holds conversation 0, expected 2 \(written by two"
    ):
        read_output(path)
