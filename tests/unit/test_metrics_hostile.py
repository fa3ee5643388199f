"""Hostile metrics files: every reader (the monitor's FileTail and follower, plot's loader, TensorBoard's
records) bounds what it keeps -- a line too long, too deeply nested (json.loads recurses) or with a list
too long is skipped and counted, in bounded time and memory -- and refuses a metrics.jsonl that is a
directory or a FIFO with one line instead of a traceback or a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc

import pytest

from core import attach, metrics
from core.config import Config
from core.metrics import FileTail, MetricsFollower, read_all
from core.monitor import Monitor
from tests.unit.test_attach import ROOT, append, line, plain_console

DEEP = [b"[" * 100_000, b'{"a": [' * 30_000, b'{"a": ' * 50_000, b"[" * 5_000 + b"]" * 5_000]
LIST_3MB = b'{"step": 5, "time": 1005, "role": "learner", "id": "learner", "staleness/hist": [' + \
    b"0.5, " * 600_000 + b"1]}"
LINE_6MB = b'{"step": 6, "time": 1006, "role": "learner", "id": "learner", "x": "' + b"y" * (6 << 20) + b'"}'


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=30)


@pytest.mark.parametrize("deep", DEEP)
def test_a_deeply_nested_line_is_skipped_and_counted(tmp_path, deep):
    append(tmp_path / "metrics.jsonl", line(1) + deep + b"\n" + line(2))
    f = FileTail(str(tmp_path / "metrics.jsonl"))
    assert [r.step for r in read_all(f)] == [1, 2] and f.bad_lines == 1
    os.makedirs(tmp_path / "metrics")  # the launcher's follower (and TensorBoard's records) as well
    append(tmp_path / "metrics" / "learner-learner.jsonl", line(3) + deep + b"\n" + line(4))
    with MetricsFollower(str(tmp_path)) as follower:
        assert [r.step for r in read_all(follower)] == [3, 4] and follower.bad_lines == 1


def test_brackets_inside_strings_are_not_nesting():
    row = b'{"step": 1, "time": 1, "role": "[[[[[[[[[[", "id": "\\"{{{{{{{{{{", "a/b": [1, 2]}'
    assert metrics.bounded_json(row)["role"] == "[[[[[[[[[["
    with pytest.raises(ValueError, match="deeper"):
        metrics.bounded_json(b'{"a": ' + b"[" * 9 + b"]" * 9 + b"}")
    assert metrics.bounded_json(b'{"a": ' + b"[" * 7 + b"]" * 7 + b"}")


def test_huge_lines_are_skipped_in_bounded_time_and_memory(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, line(1) + LIST_3MB + b"\n" + line(2) + LINE_6MB + b"\n" + line(3))
    f = FileTail(str(path))
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        steps = [r.step for r in read_all(f)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert steps == [1, 2, 3] and f.bad_lines == 2
    assert time.monotonic() - t0 < 5 and peak < 16 << 20, (time.monotonic() - t0, peak)


def test_a_line_growing_past_the_limit_is_dropped_as_it_comes_and_counted_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    f = FileTail(str(path))
    append(path, line(1) + b'{"step": 2, "time": 1, "role": "l", "id": "l", "x": "' + b"y" * (3 << 20))  # no newline yet: read in slices
    assert [r.step for r in read_all(f)] == [1] and len(f._partial) <= metrics.MAX_LINE
    append(path, b"y" * (2 << 20) + b'"}\n' + line(3))
    assert [r.step for r in read_all(f)] == [3] and f.bad_lines == 1


def test_a_list_past_max_list_is_dropped_and_counted_and_the_view_stays_short(tmp_path):
    hist = [1.0] * (metrics.MAX_LIST + 1)
    append(tmp_path / "metrics.jsonl", line(1, **{"staleness/hist": hist}) + line(2, **{"staleness/hist": hist[:900]}))
    f = FileTail(str(tmp_path / "metrics.jsonl"))
    recs = read_all(f)
    assert "staleness/hist" not in recs[0].values and f.values_dropped == 1 and f.bad_lines == 0
    m = Monitor(Config(), plain_console()[0], live=False)
    m.update(recs)
    assert len(recs[1].values["staleness/hist"]) == 900 and len(m.format_line()) < 400


def test_replay_and_plot_of_a_hostile_run_show_what_was_skipped(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from core import plots

    append(tmp_path / "metrics.jsonl", line(1) + DEEP[0] + b"\n" + LIST_3MB + b"\n" + LINE_6MB + b"\n" + line(2))
    console, out = plain_console()
    assert attach.attach(str(tmp_path), console=console, live="off") == 0
    assert "3 unreadable lines skipped" in out.getvalue() and len(out.getvalue()) < 1000
    assert [r.step for r in plots.load(str(tmp_path))] == [1, 2]
    assert capsys.readouterr().err.count("3 lines and 0 values skipped") == 1


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_metrics_file_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, kind):
    path = tmp_path / "metrics.jsonl"
    os.mkdir(path) if kind == "directory" else os.mkfifo(path)
    f = FileTail(str(path))
    assert f.read() == [] and f.caught_up()  # never opened: a FIFO would hang
    for cmd in ("monitor", "plot"):
        out = cli(cmd, str(tmp_path))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip() == f"{cmd}: {path} is not a regular file (a directory or FIFO, say): not read"
    assert not os.path.exists(tmp_path / "plots")


def test_a_role_file_that_is_a_fifo_is_not_read(tmp_path):
    os.makedirs(tmp_path / "metrics")
    os.mkfifo(tmp_path / "metrics" / "actor-actor0.jsonl")
    append(tmp_path / "metrics" / "learner-learner.jsonl", line(1))
    with MetricsFollower(str(tmp_path), merge=True) as follower:
        assert [r.step for r in read_all(follower)] == [1]
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1]
