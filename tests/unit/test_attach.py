"""run.py monitor: following the roles' metrics files (or an older run's metrics.jsonl), the
job-alive check, replay and follow, the view's restart line, and that the command never imports
torch."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from core import attach
from core.attach import job_running
from core.config import Config
from core.messages import MetricRecords
from core.metrics import FileTail, MetricsFollower, MetricsWriter, record_from_json, record_to_json
from core.monitor import Monitor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def line(step: int, role: str = "learner", **values) -> bytes:
    vals = {"ratio/p99": 1.0 + step / 100, "learner/step": float(step), **values}
    rec = MetricRecords(role=role, id=role, step=step, time=1000.0 + step, values=vals)
    return record_to_json(rec) + b"\n"


def append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_follower_keeps_a_partial_line_until_its_newline_arrives(tmp_path):
    path = tmp_path / "metrics.jsonl"
    f = FileTail(str(path))
    assert f.read() == []  # no file yet: nothing, no error
    whole = line(1)
    append(path, line(0) + whole[:10])
    assert [r.step for r in f.read()] == [0]
    append(path, whole[10:-1])
    assert f.read() == []
    append(path, b"\n" + line(2))
    recs = f.read()
    assert [r.step for r in recs] == [1, 2] and recs[0].values["ratio/p99"] == pytest.approx(1.01)
    assert f.caught_up() and f.bad_lines == 0


def test_follower_counts_and_skips_lines_that_are_not_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    garbage = [b"not json", b'{"step": "x", "time": 1, "role": "a", "id": "b"}', b"[1, 2]", b"\xff\xfe"]
    append(path, line(0) + b"\n".join(garbage) + b"\n\n" + line(1))
    f = FileTail(str(path))
    assert [r.step for r in f.read()] == [0, 1]
    assert f.bad_lines == len(garbage)


def test_record_from_json_inverts_record_to_json_with_null_as_nan():
    rec = MetricRecords(role="learner", id="l", step=3, time=12.5,
                        values={"a": 1.5, "b": math.nan, "hist": [1.0, math.nan, 3.0]})
    back = record_from_json(json.loads(record_to_json(rec)))
    assert (back.role, back.id, back.step, back.time) == ("learner", "l", 3, 12.5)
    assert back.values["a"] == 1.5 and math.isnan(back.values["b"])
    assert back.values["hist"][0] == 1.0 and math.isnan(back.values["hist"][1])
    assert "s" not in record_from_json({"step": 1, "time": 1, "role": "r", "id": "i", "s": "text"}).values
    with pytest.raises(ValueError, match="step"):
        record_from_json({"step": True, "time": 1.0, "role": "r", "id": "i"})


def write_pids(run_dir, pid: int) -> None:
    (run_dir / "pids.json").write_text(json.dumps({"launcher": pid, "learner": pid}))


def test_job_running_follows_the_launcher_pid(tmp_path):
    assert not job_running(str(tmp_path))  # no pids.json: never started
    write_pids(tmp_path, os.getpid())
    assert job_running(str(tmp_path))
    # a pid that started long after pids.json was written is not that launcher (pid reuse)
    old = time.time() - 10 * 86400
    os.utime(tmp_path / "pids.json", (old, old))
    assert not job_running(str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    write_pids(tmp_path, p.pid)
    assert not job_running(str(tmp_path))
    (tmp_path / "pids.json").write_text("{torn")
    assert not job_running(str(tmp_path))


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=300, force_terminal=False, color_system=None), out


def test_replay_of_a_finished_run_shows_the_last_record_once(tmp_path):
    append(tmp_path / "metrics.jsonl", line(1) + b"garbage\n" + line(2) + line(3))
    console, out = plain_console()
    assert attach.attach(str(tmp_path), console=console, live="off") == 0
    text = out.getvalue()
    assert text.count("\n") == 1, text  # one final line, not one per record
    assert "step 3" in text and "p99 1.03" in text and "the job has ended" in text
    assert "1 unreadable lines skipped" in text
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # nothing written into the run


def test_follow_shows_new_records_and_stops_when_the_launcher_is_gone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, line(1))
    write_pids(tmp_path, os.getpid())
    console, out = plain_console()
    monitor = Monitor(attach.run_config(str(tmp_path)), console, live=False)
    monitor.refresh_s = monitor.plain_every_s = 0.01

    def job():
        time.sleep(0.3)
        append(path, line(2))
        time.sleep(0.3)
        append(path, line(3))
        os.remove(tmp_path / "pids.json")  # the launcher is gone

    t = threading.Thread(target=job)
    t.start()
    attach.follow(monitor, FileTail(str(path)), str(tmp_path), keep_waiting=False, poll_s=0.02)
    t.join()
    monitor.refresh(force=True)
    text = out.getvalue()
    assert "step 1" in text and "step 2" in text and "attached" in text
    assert monitor.get("learner/step") == 3.0 and "the job has ended" in monitor.note


def emit(run_dir, role: str, id: str, step: int, **values) -> None:
    with MetricsWriter(str(run_dir), role, id) as w:
        w.emit(step, {"learner/step": float(step), "ratio/p99": 1.0 + step / 100, **values})


def test_replay_follows_the_role_files_the_launcher_never_merged(tmp_path):
    for step in (1, 2, 3):
        emit(tmp_path, "learner", "learner0", step)
    emit(tmp_path, "actor", "actor0", 3, **{"actor/version": 3.0})
    console, out = plain_console()
    assert attach.attach(str(tmp_path), console=console, live="off") == 0  # no metrics.jsonl at all
    text = out.getvalue()
    assert "step 3" in text and "p99 1.03" in text and "the job has ended" in text
    assert sorted(os.listdir(tmp_path)) == ["metrics"]  # nothing written into the run


def test_follow_picks_up_a_role_file_that_appears(tmp_path):
    emit(tmp_path, "learner", "learner0", 1)
    write_pids(tmp_path, os.getpid())
    monitor = Monitor(attach.run_config(str(tmp_path)), plain_console()[0], live=False)

    def job():
        time.sleep(0.3)
        emit(tmp_path, "actor", "actor0", 2, **{"actor/version": 2.0})  # an actor starts late
        emit(tmp_path, "learner", "learner0", 3)
        time.sleep(0.3)
        os.remove(tmp_path / "pids.json")

    t = threading.Thread(target=job)
    t.start()
    attach.follow(monitor, MetricsFollower(str(tmp_path)), str(tmp_path), keep_waiting=False, poll_s=0.02)
    t.join()
    assert monitor.get("learner/step") == 3.0 and monitor.actor_versions() == {"actor0": 2}
    assert monitor.records == 3 and "the job has ended" in monitor.note


def test_monitor_cli_errors_exit_2(tmp_path, capsys):
    assert attach.main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert attach.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        attach.main([str(tmp_path), "--speed", "-1"])


def test_view_shows_restarts_and_the_last_one():
    m = Monitor(Config(), plain_console()[0], live=False)
    assert m.restarts_text() is None
    now = time.time()
    m.update([MetricRecords(role="launcher", id="launcher", step=-1, time=now - 5, values={"run/restarts/actor0": 1.0}),
              MetricRecords(role="launcher", id="launcher", step=-1, time=now, values={"run/restarts/learner": 1.0})])
    text = m.format_line()
    assert "restarts 2 · last learner" in text
    m.update([MetricRecords(role="launcher", id="launcher", step=-1, time=now, values={"run/restarts/learner": 1.0})])
    assert m.last_restart[0] == "learner"  # the same count again is not a new restart


def test_monitor_and_plot_commands_do_not_import_torch(tmp_path):
    append(tmp_path / "metrics.jsonl", line(1) + line(2))
    code = ("import sys; sys.modules['torch'] = None\nimport run\n"
            f"assert run.main(['monitor', {str(tmp_path)!r}, '--live', 'off']) == 0\n"
            f"assert run.main(['plot', {str(tmp_path)!r}]) == 0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["plots"]


def test_paced_replay_groups_records_by_time_and_bounds_each_sleep():
    recs = [MetricRecords(role="r", id="i", step=s, time=t, values={}) for s, t in enumerate((0.0, 0.0, 1.0, 50.0))]
    assert [len(b) for b in attach.paced(recs, 0.0)] == [4]  # no pacing: all at once
    t0 = time.monotonic()
    assert [[r.step for r in b] for b in attach.paced(recs, 100.0, max_gap_s=0.05)] == [[0, 1], [2], [3]]
    assert time.monotonic() - t0 < 2.0  # 0.01 s, then 0.49 s capped at 0.05 s


@pytest.mark.parametrize("value,t", [(math.inf, 1.0), (math.nan, math.nan), (-3.0, math.inf), (1e308, -1e308)])
def test_hostile_restart_records_never_break_the_view(value, t):
    m = Monitor(Config(), plain_console()[0], live=False)
    m.update([MetricRecords(role="launcher", id="launcher", step=-1, time=t, values={"run/restarts/a": value})])
    m.format_line()
    Console(file=io.StringIO(), width=80).print(m.renderable())
    assert m.render_errors == 0
