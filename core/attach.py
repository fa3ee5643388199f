"""``python run.py monitor [RUN_DIR]``: the live view of a job started in another terminal. It reads
the roles' files under ``run_dir/metrics/`` (an older run: its ``metrics.jsonl``) and never writes into
the run or sends the job a byte, so detaching cannot disturb it and a finished run replays. The job runs
while the launcher pid of ``pids.json`` lives."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time

from core import config as C
from core.messages import MetricRecords
from core.files import read_json, run_file
from core.metrics import MERGED_FILE, METRICS_DIR, FileTail, MetricsFollower, read_all, regular
from core.monitor import Monitor
from core.proc import pid_alive

Follower = MetricsFollower | FileTail


def launcher_pid(run_dir: str) -> int | None:
    pids = read_json(os.path.join(run_dir, "pids.json"))
    pid = pids.get("launcher") if isinstance(pids, dict) else None
    return pid if isinstance(pid, int) and pid > 0 else None


def job_running(run_dir: str) -> bool:
    """The launcher lives: not a zombie, nor a process started after pids.json was written (a reused pid)."""
    pid = launcher_pid(run_dir)
    if pid is None or not pid_alive(pid):
        return False
    try:  # Linux /proc; True elsewhere
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
        written = os.path.getmtime(os.path.join(run_dir, "pids.json"))
    except (OSError, StopIteration, IndexError, ValueError):
        return True
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    # 2 s of slack: btime and the start time are whole seconds and ticks
    return fields[0] != "Z" and started <= written + 2.0


def metrics_path(run_dir: str) -> str:
    """The run's merged ``metrics.jsonl``; FileNotFoundError without one, OSError for a directory or FIFO."""
    if not regular(path := run_file(run_dir, MERGED_FILE, "not a driftrl run directory, or its launcher has not "
                                    "started yet")):
        raise OSError(f"{path} is not a regular file (a directory or FIFO, say): not read")
    return path


def run_config(run_dir: str):
    """The run's config (the view's budgets); the defaults if unreadable."""
    try:
        return C.from_dict(read_json(os.path.join(run_dir, "config.json")))
    except C.ConfigError:  # also when missing (None) or torn
        return C.Config()


def paced(records: list[MetricRecords], speed: float, max_gap_s: float = 2.0):
    """``records`` in batches of equal time, each after the real gap / ``speed`` (<= ``max_gap_s``); 0: one batch."""
    if speed <= 0 or not records:
        yield records
        return
    last = records[0].time
    for t, batch in itertools.groupby(records, key=lambda r: r.time):
        time.sleep(min(max(t - last, 0.0) / speed, max_gap_s))
        last = max(last, t)
        yield list(batch)


def _status(follower: Follower, text: str) -> str:
    bad = f" · {follower.bad_lines} unreadable lines skipped" if follower.bad_lines else ""
    return text + bad + (f" · file restarted {follower.resets}x" if follower.resets else "")


def drain(monitor, follower: Follower, speed: float = 0.0) -> None:
    """Feed everything up to the end of the files (paced by ``speed``: a redraw per batch)."""
    for batch in paced(read_all(follower), speed):
        monitor.update(batch)
        if speed > 0:  # unpaced, the view is drawn once, with the last record (on exit)
            monitor.refresh(force=True)


def follow(monitor, follower: Follower, run_dir: str, keep_waiting: bool, poll_s: float = 0.25) -> None:
    """Show the records as they arrive until the launcher is gone (forever with ``keep_waiting``)."""
    while True:
        running = job_running(run_dir)  # before the read: what it wrote before it ended is read
        monitor.update(follower.read())
        if not running and not keep_waiting:
            drain(monitor, follower)
            monitor.note = _status(follower, f"the job has ended (launcher {launcher_pid(run_dir) or '?'} is gone)")
            return
        monitor.note = _status(follower, "attached" if running else "waiting for the job (--follow)")
        monitor.refresh()
        if follower.caught_up():
            time.sleep(poll_s)


def attach(run_dir: str, keep_waiting: bool = False, speed: float = 0.0, console=None, live: str = "auto") -> int:
    """Follow a running job, or replay a finished one; 0 when it ends. ``live``: this terminal's monitor.live."""
    role_files = os.path.isdir(os.path.join(run_dir, METRICS_DIR))
    follower = MetricsFollower(run_dir) if role_files else FileTail(metrics_path(run_dir))
    monitor = Monitor(run_config(run_dir), console, live)
    # Ctrl-C detaches: nothing to clean up, the job never knew we were here
    with contextlib.suppress(KeyboardInterrupt), monitor:
        if keep_waiting or job_running(run_dir):
            follow(monitor, follower, run_dir, keep_waiting)
        else:
            monitor.note = "replay: the job has ended"
            drain(monitor, follower, speed)
            monitor.note = _status(follower, monitor.note)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="run.py monitor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?", default=os.path.join("runs", "latest"))
    ap.add_argument("--follow", action="store_true",
                    help="keep waiting for new records after the job has ended (a resume)")
    ap.add_argument("--speed", type=float, default=0.0,
                    help="replay a finished run at X times its real pace (0: show the end at once)")
    ap.add_argument("--live", choices=("auto", "on", "off"), default="auto",
                    help="auto: the rich view on a terminal, plain lines otherwise")
    args = ap.parse_args(argv)
    if not args.speed >= 0:  # also NaN
        ap.error(f"--speed must be >= 0, got {args.speed}")
    try:
        return attach(args.run_dir, args.follow, args.speed, live=args.live)
    except OSError as e:  # no run, or metrics.jsonl is a directory or FIFO
        print(f"monitor: {e}", file=sys.stderr)
        return 2
