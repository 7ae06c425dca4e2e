"""MetricWriter: JSONL content, NaN as null, TensorBoard events, truncation on resume, process 0 only, and a
`gs://` work directory (an object store without appends) giving the local file."""

import json
import logging
import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from tensorboardX.proto import event_pb2

from dspark_jax.training import metrics_writer
from dspark_jax.training.metrics_writer import MetricWriter
from tests.data.fake_gcs import fake_gcs


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _metrics(step: int) -> dict:
    return {"train/loss": 3.0 / step, "train/tau": np.float32(1.5), "train/lr": jnp.asarray(step * 1e-4)}


def test_writes_jsonl_and_tensorboard(tmp_path):
    with MetricWriter(tmp_path) as writer:
        writer.write(
            1, {"train/loss": 2.5, "train/tau": np.float32(1.25), "train/grad_norm": jnp.asarray(0.5)}
        )
        writer.write(2, {"train/loss": float("nan"), "eval/mal": np.array(3.0), "train/x": math.inf})
    assert _lines(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/loss": 2.5, "train/tau": 1.25, "train/grad_norm": 0.5},
        {"step": 2, "train/loss": None, "eval/mal": 3.0, "train/x": None},
    ]
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    data = events.read_bytes()
    assert b"train/loss" in data and b"eval/mal" in data


def read_events(path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a TensorBoard event file, parsed independently (TFRecord framing + Event protos)."""
    data, out, at = path.read_bytes(), {}, 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
        at += 12 + length + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_tags_equal_the_jsonl_keys(tmp_path):
    """A real run's metrics: TensorBoard shows every JSONL key under the same name, same values."""
    metrics = {
        "train/loss": 1.5,
        "train/accept_rate_0": 0.25,
        "eval/accept_rate_6": 0.125,
        "train/confidence_cumprod_bias": -0.5,
    }
    with MetricWriter(tmp_path) as writer:
        writer.write(3, metrics)
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    tags = read_events(events)
    (line,) = _lines(tmp_path / "metrics.jsonl")
    assert set(tags) == set(line) - {"step"} == set(metrics)
    assert all(tags[name] == [(3, pytest.approx(value))] for name, value in metrics.items())
    with MetricWriter(tmp_path, resume_step=3) as writer, pytest.raises(ValueError, match="accept_rate@0"):
        writer.write(4, {"train/accept_rate@0": 0.5})


def test_rejects_non_scalars_and_the_step_key(tmp_path):
    with MetricWriter(tmp_path, enable_tensorboard=False) as writer:
        with pytest.raises(ValueError, match="'train/loss' must be a scalar"):
            writer.write(1, {"train/loss": np.ones(2)})
        with pytest.raises(ValueError, match="reserved"):
            writer.write(1, {"step": 1.0})
    assert not (tmp_path / "tensorboard").exists()


def test_resume_drops_lines_after_the_checkpoint(tmp_path):
    with MetricWriter(tmp_path / "straight", enable_tensorboard=False) as writer:
        for step in range(1, 11):
            writer.write(step, _metrics(step))

    # Killed at step 9 after a checkpoint at step 6, mid-way through writing a line.
    killed = tmp_path / "killed"
    with MetricWriter(killed, enable_tensorboard=False) as writer:
        for step in range(1, 10):
            writer.write(step, _metrics(step))
    with (killed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 10, "train/lo')
    with MetricWriter(killed, resume_step=6) as writer:
        for step in range(7, 11):
            writer.write(step, _metrics(step))

    assert (killed / "metrics.jsonl").read_text() == (tmp_path / "straight" / "metrics.jsonl").read_text()


def test_fresh_run_clears_and_corrupt_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\nnot json\n{"step": 2, "a": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not a JSON line"):
        MetricWriter(tmp_path, resume_step=1, enable_tensorboard=False)
    path.write_text('{"step": 1, "a": 1.0}\n')
    MetricWriter(tmp_path, resume_step=0, enable_tensorboard=False).close()
    assert path.read_text() == ""


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """`gs://bucket/...` stored in `<tmp_path>/gcs/bucket/...`, refusing appends as an object store does."""
    opened = epath.gpath.PosixGPath.open

    def open_(path, mode="r", *args, **kwargs):
        if "a" in mode and str(path).startswith("gs://"):
            raise OSError(f"{path}: an object store cannot append")
        return opened(path, mode, *args, **kwargs)

    monkeypatch.setattr(epath.gpath.PosixGPath, "open", open_)
    with fake_gcs(tmp_path / "gcs"):
        yield tmp_path / "gcs"


def _run(workdir, steps, writer=None, **kwargs):
    """Logs a run's lines for `steps` (train lines, an eval line with a NaN every third step)."""
    writer = writer or MetricWriter(workdir, enable_tensorboard=False, **kwargs)
    for step in steps:
        writer.write(step, _metrics(step))
        if step % 3 == 0:
            writer.write(step, {"eval/tau_prob": 1.0 + step / 10, "eval/mal": math.nan})
    return writer


def test_only_process_zero_writes(tmp_path, monkeypatch, gcs):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    for workdir in (tmp_path / "w", "gs://bucket/w"):
        with MetricWriter(workdir, resume_step=0) as writer:
            writer.write(1, {"train/loss": 1.0})
            writer.flush()
    assert not (tmp_path / "w").exists() and not gcs.exists()


def test_a_gs_work_directory_gets_the_local_file_without_appends(tmp_path, gcs):
    _run(tmp_path / "local", range(1, 11)).close()
    local = (tmp_path / "local" / "metrics.jsonl").read_bytes()
    uploaded = gcs / "bucket" / "run" / "metrics.jsonl"
    # Uploaded on start, on flush and on close (or on every write with sync_seconds=0).
    writer = _run("gs://bucket/run", range(1, 5), sync_seconds=math.inf)
    assert uploaded.read_text() == ""
    writer.flush()
    assert [line["step"] for line in _lines(uploaded)] == [1, 2, 3, 3, 4]
    _run(None, range(5, 11), writer).close()
    assert uploaded.read_bytes() == local
    with pytest.raises(ValueError, match="closed"):
        writer.write(11, _metrics(11))
    with _run("gs://bucket/each", range(1, 4), sync_seconds=0):
        assert _lines(gcs / "bucket" / "each" / "metrics.jsonl") == _lines(uploaded)[:4]


@pytest.mark.parametrize("sync_seconds", [0.0, math.inf])
def test_a_resumed_gs_writer_keeps_the_lines_up_to_its_step(tmp_path, gcs, sync_seconds):
    """Killed at step 9 after a checkpoint at step 6 (the loop flushes before saving); uploaded on every write
    (steps 7-9 to drop) or never since the flush (the object ends at step 6)."""
    _run(tmp_path / "straight", range(1, 11)).close()
    writer = _run("gs://bucket/run", range(1, 7), sync_seconds=sync_seconds)
    writer.flush()
    _run(None, range(7, 10), writer)  # killed: never closed
    uploaded = gcs / "bucket" / "run" / "metrics.jsonl"
    assert _lines(uploaded)[-1]["step"] == (9 if sync_seconds == 0 else 6)
    with MetricWriter("gs://bucket/run", resume_step=6, enable_tensorboard=False) as resumed:
        _run(None, range(7, 11), resumed)
    assert uploaded.read_bytes() == (tmp_path / "straight" / "metrics.jsonl").read_bytes()
    with MetricWriter("gs://bucket/run", resume_step=None, enable_tensorboard=False):  # appends: keeps all
        pass
    assert uploaded.read_bytes() == (tmp_path / "straight" / "metrics.jsonl").read_bytes()


def test_tensorboard_under_gs_needs_its_upload_package(gcs, monkeypatch, caplog):
    """Without google-cloud-storage one warning says so and metrics.jsonl is still written; with it
    tensorboardX gets the URL itself (it uploads each events object whole, no tensorflow needed)."""
    monkeypatch.setitem(metrics_writer._TENSORBOARD_UPLOADERS, "gs", ("google-cloud-storage", False))
    with caplog.at_level(logging.WARNING), MetricWriter("gs://bucket/run", resume_step=0) as writer:
        writer.write(1, {"train/loss": 1.0})
    (warning,) = caplog.records
    assert (
        "google-cloud-storage" in warning.getMessage() and "metrics.jsonl is written" in warning.getMessage()
    )
    assert _lines(gcs / "bucket" / "run" / "metrics.jsonl") == [{"step": 1, "train/loss": 1.0}]

    opened = []
    monkeypatch.setitem(metrics_writer._TENSORBOARD_UPLOADERS, "gs", ("google-cloud-storage", True))
    monkeypatch.setattr(
        metrics_writer, "SummaryWriter", lambda logdir, **kwargs: opened.append((logdir, kwargs))
    )
    MetricWriter("gs://bucket/run", resume_step=4)
    assert opened == [("gs://bucket/run/tensorboard", {"purge_step": 5})]
