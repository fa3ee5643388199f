"""``python run.py monitor [RUN_DIR]``: the live view of a job started in another terminal.

It follows the roles' files under ``run_dir/metrics/`` with the launcher's own, read-only
:class:`~core.metrics.MetricsFollower` (a run from before them: its ``metrics.jsonl``), so it never
writes into the run or sends the job a byte: detaching cannot disturb it, a finished run replays
from the same files, and what the roles wrote shows even when the launcher never merged it.
The job runs while the launcher pid of ``pids.json`` lives: a zombie, or a process that started
after ``pids.json`` was written (the pid reused), means it has ended.
"""

from __future__ import annotations

import json
import os
import time

from core.messages import MetricRecords
from core.files import run_file
from core.metrics import MERGED_FILE, METRICS_DIR, FileTail, MetricsFollower, read_all

POLL_S = 0.25
Follower = MetricsFollower | FileTail  # the two share read(), caught_up(), bad_lines, resets


class AttachError(Exception):
    """A run directory that cannot be attached to (``run.py monitor`` exits 2)."""


def launcher_pid(run_dir: str) -> int | None:
    """The launcher pid of ``pids.json``; None without one (or an unreadable one)."""
    try:
        with open(os.path.join(run_dir, "pids.json")) as f:
            pid = json.load(f).get("launcher")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and pid > 0 else None


def job_running(run_dir: str) -> bool:
    pid = launcher_pid(run_dir)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    try:  # not a zombie, and started before pids.json was written (Linux /proc; True elsewhere)
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
    """The run's merged ``metrics.jsonl`` (AttachError without one)."""
    try:
        return run_file(run_dir, MERGED_FILE,
                        "not a driftrl run directory, or its launcher has not started yet")
    except FileNotFoundError as e:
        raise AttachError(str(e)) from None


def follower_of(run_dir: str) -> Follower:
    if os.path.isdir(os.path.join(run_dir, METRICS_DIR)):
        return MetricsFollower(run_dir)
    return FileTail(metrics_path(run_dir))


def run_config(run_dir: str):
    """The run's config (for the view's step and time budgets); the defaults if unreadable."""
    from core import config as C

    try:
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            return C.from_dict(json.loads(f.read()))
    except (OSError, ValueError, C.ConfigError):
        return C.Config()


def paced(records: list[MetricRecords], speed: float, max_gap_s: float = 2.0):
    """``records`` in batches of equal time, with a sleep of the real gap / ``speed`` (at most
    ``max_gap_s``) before each: a replay you can watch. ``speed`` 0: one batch, no sleep."""
    if speed <= 0 or not records:
        yield records
        return
    batch, t = [], records[0].time
    for rec in records:
        if rec.time > t and batch:
            yield batch
            time.sleep(min((rec.time - t) / speed, max_gap_s))
            batch, t = [], rec.time
        batch.append(rec)
    yield batch


def _status(follower: Follower, text: str) -> str:
    if follower.bad_lines:
        text += f" · {follower.bad_lines} unreadable lines skipped"
    return text + (f" · file restarted {follower.resets}x" if follower.resets else "")


def drain(monitor, follower: Follower, speed: float = 0.0) -> None:
    """Feed everything up to the end of the files (paced by ``speed``: a redraw per batch)."""
    for batch in paced(read_all(follower), speed):
        monitor.update(batch)
        if speed > 0:  # unpaced, the view is drawn once, with the last record (on exit)
            monitor.refresh(force=True)


def follow(monitor, follower: Follower, run_dir: str, keep_waiting: bool, poll_s: float = POLL_S) -> None:
    """Show the records as they arrive until the launcher is gone (forever with ``keep_waiting``)."""
    while True:
        running = job_running(run_dir)  # before the read: what it wrote before it ended is read
        monitor.update(follower.read())
        if not running and not keep_waiting:
            drain(monitor, follower)
            pid = launcher_pid(run_dir)
            monitor.note = _status(follower, f"the job has ended (launcher {pid or '?'} is gone)")
            return
        monitor.note = _status(follower, "attached" if running else "waiting for the job (--follow)")
        monitor.refresh()
        if follower.caught_up():
            time.sleep(poll_s)


def attach(run_dir: str, keep_waiting: bool = False, speed: float = 0.0, console=None,
           live: str = "auto") -> int:
    """``run.py monitor``: follow a running job, or replay a finished one; 0 when it ends.
    ``live`` is this terminal's choice (``monitor.live``), not the one the job was started with."""
    import msgspec

    from core.monitor import Monitor

    follower, cfg = follower_of(run_dir), run_config(run_dir)
    cfg = msgspec.structs.replace(cfg, monitor=msgspec.structs.replace(cfg.monitor, live=live))
    monitor = Monitor(cfg, console)
    try:
        with monitor:
            if keep_waiting or job_running(run_dir):
                follow(monitor, follower, run_dir, keep_waiting)
            else:
                monitor.note = "replay: the job has ended"
                drain(monitor, follower, speed)
                monitor.note = _status(follower, monitor.note)
    except KeyboardInterrupt:  # detaching: nothing to clean up, the job never knew we were here
        pass
    return 0


def main(argv=None) -> int:
    import argparse
    import sys

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
    except AttachError as e:
        print(f"monitor: {e}", file=sys.stderr)
        return 2
