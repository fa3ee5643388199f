"""Metrics as files (core/metrics.py): each role appends to its own JSON-lines file, one follower
tails them all and merges them into metrics.jsonl; and the numeric helpers of core/stats.py."""

import json
import logging
import math
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from core.messages import MetricRecords
from core.metrics import (MERGED_FILE, FileTail, MetricsFollower, MetricsWriter, merge_pending,
                          record_to_json)
from core.stats import dense_histogram

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def merged(run_dir, role=None):
    """The merged metrics.jsonl, without the counter records (or only ``role``'s)."""
    rows = read_jsonl(os.path.join(run_dir, MERGED_FILE))
    return [r for r in rows if (r["role"] == role if role else r["role"] != "monitor")]


def append(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab") as f:
        f.write(data)


def line(role: str, step: int, t: float = 1000.0, **values) -> bytes:
    rec = MetricRecords(role=role, id=role, step=step, time=t + step, values={"x": float(step), **values})
    return record_to_json(rec) + b"\n"


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path)


@pytest.fixture
def follower(run_dir):
    f = MetricsFollower(run_dir, merge=True)
    yield f
    f.close()


def test_round_trip_values_nan_and_inf(run_dir, follower):
    with MetricsWriter(run_dir, "learner", "0") as w:
        w.emit(1, {"ratio/p99": 1.08, "learner/step": 1})
        w.emit(2, {"learner/loss": float("nan"), "ratio/max": np.float32(1.5)})
        w.emit(3, {"staleness/hist": np.array([4, 2, 0, 1]), "reward/mean": float("inf"),
                   "ratio/min": [1.0, -math.inf]})
    recs = [r for r in follower.read() if r.role != "monitor"]

    assert [r.step for r in recs] == [1, 2, 3] and all((r.role, r.id) == ("learner", "0") for r in recs)
    assert recs[0].values == {"ratio/p99": 1.08, "learner/step": 1.0}
    assert math.isnan(recs[1].values["learner/loss"])  # "no value": kept, not dropped
    assert recs[2].values == {"staleness/hist": [4.0, 2.0, 0.0, 1.0]}  # ±inf: an overflow, dropped
    assert w.values_dropped == 2 and w.write_errors == 0

    rows = merged(run_dir)
    assert [(r["step"], r["role"], r["id"]) for r in rows] == [(1, "learner", "0"), (2, "learner", "0"),
                                                                 (3, "learner", "0")]
    assert [r["time"] for r in rows] == pytest.approx([r.time for r in recs])
    assert rows[1]["learner/loss"] is None and rows[1]["ratio/max"] == 1.5  # NaN -> null
    assert "reward/mean" not in rows[2] and rows[2]["staleness/hist"] == [4.0, 2.0, 0.0, 1.0]
    counters = merged(run_dir, "monitor")
    assert counters[-1]["id"] == "learner-0" and counters[-1]["monitor/values_dropped"] == 2.0


def test_envelope_fields_win_over_metric_names():
    rec = MetricRecords(role="actor", id="1", step=7, time=5.0, values={"step": 99.0, "a/b": 1.0})
    row = json.loads(record_to_json(rec))
    assert row["step"] == 7 and row["a/b"] == 1.0 and row["role"] == "actor"


def test_jsonl_line_decodes_as_json_object():
    rec = MetricRecords(role="a", id="0", step=1, time=2.0, values={"x": [1.0, float("nan")]})
    assert msgspec.json.decode(record_to_json(rec)) == {
        "step": 1, "time": 2.0, "role": "a", "id": "0", "x": [1.0, None]
    }


@pytest.mark.parametrize("bad", ["1.0", True, {"a": 1.0}, [1.0, "x"], None])
def test_writer_rejects_non_numeric_values(run_dir, bad):
    w = MetricsWriter(run_dir, "learner", "0")
    with pytest.raises(TypeError, match="metric 'k'"):
        w.emit(0, {"k": bad})
    assert not os.path.exists(w.path)  # nothing written, not even the file


def test_two_roles_files_are_merged(run_dir, follower):
    learner, actor = MetricsWriter(run_dir, "learner", "learner0"), MetricsWriter(run_dir, "actor", "actor0")
    for step in range(3):
        learner.emit(step, {"learner/step": float(step)})
        actor.emit(step, {"actor/tokens_per_s": 10.0 * step})
    assert sorted(os.listdir(os.path.join(run_dir, "metrics"))) == ["actor-actor0.jsonl", "learner-learner0.jsonl"]
    assert len(follower.read()) == 6
    rows = merged(run_dir)
    assert [r["step"] for r in rows if r["role"] == "learner"] == [0, 1, 2]
    assert [r["actor/tokens_per_s"] for r in rows if r["role"] == "actor"] == [0.0, 10.0, 20.0]
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)  # one time order
    learner.emit(3, {"learner/step": 3.0})  # later records of either file follow
    assert [(r.role, r.step) for r in follower.read()] == [("learner", 3)]
    assert len(merged(run_dir)) == 7


def test_a_torn_last_line_is_read_once_when_completed(run_dir, follower):
    path = os.path.join(run_dir, "metrics", "actor-actor0.jsonl")
    whole = line("actor", 1)
    append(path, line("actor", 0) + whole[:10])
    assert [r.step for r in follower.read()] == [0]
    append(path, whole[10:-1])
    assert follower.read() == []
    append(path, b"\n")
    assert [r.step for r in follower.read()] == [1]
    assert follower.read() == [] and follower.bad_lines == 0
    assert [r["step"] for r in merged(run_dir)] == [0, 1]


def test_garbage_lines_are_skipped_and_counted(run_dir, follower):
    path = os.path.join(run_dir, "metrics", "buffer-buffer.jsonl")
    garbage = [b"not json", b'{"step": "x", "time": 1, "role": "a", "id": "b"}', b"[1, 2]", b"\xff\xfe",
               b'{"step": 1, "time": NaN, "role": "a", "id": "b"}']  # a non-finite time
    inf = b'{"step": 5, "time": 1005, "role": "buffer", "id": "buffer", "x": Infinity, "y": 2}'
    append(path, line("buffer", 0) + b"\n".join(garbage) + b"\n\n" + inf + b"\n" + line("buffer", 1))
    recs = follower.read()
    assert [(r.step, r.values) for r in recs if r.role != "monitor"] == [
        (0, {"x": 0.0}), (1, {"x": 1.0}), (5, {"y": 2.0})]
    assert follower.bad_lines == len(garbage) and follower.values_dropped == 1
    counters = merged(run_dir, "monitor")
    assert counters[-1]["id"] == "follower" and counters[-1]["monitor/bad_lines"] == len(garbage)
    assert counters[-1]["monitor/values_dropped"] == 1.0


def test_a_restarted_role_appends_and_is_read(run_dir, follower):
    with MetricsWriter(run_dir, "actor", "actor0") as w:
        w.emit(1, {"actor/version": 1.0})
    assert [r.step for r in follower.read()] == [1]
    append(w.path, b'{"step": 2, "time": 10')  # the first process died in the middle of a line
    with MetricsWriter(run_dir, "actor", "actor0") as again:  # the restarted role, same file
        again.emit(3, {"actor/version": 3.0})
    assert [r.step for r in follower.read() if r.role != "monitor"] == [3]
    assert follower.bad_lines == 1  # the torn line, ended by the new writer: skipped, not glued on
    assert [r["step"] for r in merged(run_dir)] == [1, 3]


def test_a_resumed_launcher_and_the_final_eval_merge_only_what_is_new(run_dir):
    w = MetricsWriter(run_dir, "learner", "learner0")
    with MetricsFollower(run_dir, merge=True) as first:
        w.emit(1, {"learner/step": 1.0})
        append(w.path, b'{"step": 2, "time"')  # a partial line when the launcher stops
        assert [r.step for r in first.read()] == [1]
    append(w.path, b': 1002, "role": "learner", "id": "learner0"}\n')
    w.emit(3, {"learner/step": 3.0})
    with MetricsFollower(run_dir, merge=True) as second:  # `run.py resume`: a new launcher
        assert [r.step for r in second.read()] == [2, 3]
    with MetricsWriter(run_dir, "launcher", "final_eval") as final:
        final.emit(-1, {"eval/final": 1.0})
    merge_pending(run_dir)  # after the launcher: actor/evaluate.py final_eval
    merge_pending(run_dir)  # nothing new: nothing twice
    assert [(r["role"], r["step"]) for r in merged(run_dir)] == [
        ("learner", 1), ("learner", 2), ("learner", 3), ("launcher", -1)]


def test_a_read_only_follower_writes_nothing(run_dir):
    with MetricsWriter(run_dir, "learner", "0") as w:
        w.emit(1, {"learner/step": 1.0})
    with MetricsFollower(run_dir) as f:
        assert [r.step for r in f.read()] == [1]
    assert sorted(os.listdir(run_dir)) == ["metrics"]


def test_tail_rereads_a_truncated_or_replaced_file_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(str(path), line("l", 0) + line("l", 1) + line("l", 2))
    f = FileTail(str(path))
    assert len(f.read()) == 3
    path.write_bytes(line("l", 7))  # shorter than what was read: truncated
    assert [r.step for r in f.read()] == [7] and f.resets == 1
    other = tmp_path / "new.jsonl"
    other.write_bytes(line("l", 8) + line("l", 9) + line("l", 10) + line("l", 11))  # longer, another file
    os.replace(other, path)
    assert [r.step for r in f.read()] == [8, 9, 10, 11] and f.resets == 2


# ---- a file that cannot be written ----------------------------------------------------------------


def _enospc(data: bytes) -> None:
    raise OSError(28, "No space left on device")


def test_a_role_whose_file_cannot_be_written_keeps_running(run_dir, caplog):
    blocker = os.path.join(run_dir, "metrics")
    with open(blocker, "w"):  # a file where the metrics directory should be: nothing can be created
        pass
    w = MetricsWriter(run_dir, "learner", "0")
    with caplog.at_level(logging.WARNING, logger="core.metrics"):
        for step in range(3):
            w.emit(step, {"learner/step": float(step)})  # never raises
        assert w.write_errors == 3 and not os.path.exists(w.path)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and w.path in errors[0].getMessage()
        os.remove(blocker)  # room again
        w.emit(9, {"learner/step": 9.0})
    assert any("again" in r.getMessage() for r in caplog.records)
    w.close()
    rows = read_jsonl(w.path)
    assert [(r["role"], r["step"]) for r in rows] == [("learner", 9), ("monitor", -1)]
    assert rows[-1]["monitor/write_errors"] == 3.0  # and the failures are on record


def test_a_write_torn_by_a_full_disk_is_ended_before_the_next(run_dir, follower, monkeypatch):
    w = MetricsWriter(run_dir, "actor", "actor0")
    w.emit(0, {"x": 0.0})
    app = w._file

    def short(data: bytes) -> None:  # part of the line reaches the file, then the disk is full
        os.write(app._fd, data[:12])
        _enospc(data)

    monkeypatch.setattr(app, "_write", short)
    w.emit(1, {"x": 1.0})
    monkeypatch.undo()
    w.emit(2, {"x": 2.0})
    w.close()
    assert [r.step for r in follower.read() if r.role == "actor"] == [0, 2]
    assert follower.bad_lines == 1 and w.write_errors == 1  # the fragment: one garbage line


def test_a_failed_merge_write_is_counted_and_the_view_still_gets_every_record(run_dir, follower, monkeypatch,
                                                                              caplog):
    w = MetricsWriter(run_dir, "learner", "0")
    monkeypatch.setattr(follower._merged, "_write", _enospc)
    with caplog.at_level(logging.ERROR, logger="core.metrics"):
        for step in range(3):
            w.emit(step, {"learner/step": float(step)})
            assert [r.step for r in follower.read() if r.role == "learner"] == [step]
    assert follower.write_errors == 3
    assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
    monkeypatch.undo()
    w.emit(9, {"learner/step": 9.0})
    follower.read()
    rows = read_jsonl(os.path.join(run_dir, MERGED_FILE))  # every line whole JSON
    assert [(r["role"], r["step"]) for r in rows] == [("learner", 9), ("monitor", -1)]
    assert rows[-1]["monitor/write_errors"] == 3.0


def test_records_of_a_process_that_exited_are_read(run_dir, follower):
    code = ("import sys; from core.metrics import MetricsWriter\n"
            "w = MetricsWriter(sys.argv[1], 'actor', '7')\n"
            "[w.emit(i, {'actor/tokens_per_s': float(i)}) for i in range(50)]\n"
            "import os; os._exit(0)\n")  # no close, no flush at exit: every line is already written
    out = subprocess.run([sys.executable, "-c", code, run_dir], cwd=ROOT, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    recs = follower.read()
    assert [r.step for r in recs] == list(range(50)) and {(r.role, r.id) for r in recs} == {("actor", "7")}


# ---- stats ----------------------------------------------------------------------------------


def test_histogram_helpers():
    vals = [3, 0, 1, 1, np.int64(3), 3]
    assert dense_histogram(vals) == [1.0, 2.0, 0.0, 3.0]
    assert dense_histogram([]) == []
    with pytest.raises(ValueError):
        dense_histogram([0, -1])
