"""Process plumbing shared by every role: dying with the launcher, a private umask, the
signal-driven stop flag, logging, the exit status of a failed write, and the memory a role holds."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
# a role that could not write what it must (a checkpoint on a full disk, ...): EX_TEMPFAIL of
# sysexits.h, "try again later": the run is resumable once the cause is fixed. Not restarted.
EXIT_WRITE_FAILED = 75
EXIT_CORRUPT_LOG = 65  # EX_DATAERR: the buffer's store (buffer.durable --drop-damaged) or every checkpoint damaged
ORPHAN_POLL_S = 0.5
ORPHAN_GRACE_S = 15.0  # after the launcher is gone: time to stop cleanly before a hard exit
# /proc/self/status fields -> metric names: resident now, its peak, and the part that is mapped
# shared memory (an actor's mapped weight version in /dev/shm counts there, once per machine)
_MEMORY = {"VmRSS": "rss_mb", "VmHWM": "peak_rss_mb", "RssShmem": "shm_mb"}


def memory_mb() -> dict[str, float]:
    """This process's resident memory in MB (:data:`_MEMORY`); without /proc only the peak (getrusage)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return {name: int(fields[key].split()[0]) / 1024 for key, name in _MEMORY.items() if key in fields}


def learner_state_mb(params: int) -> float:
    """What a learner must hold for ``params`` parameters, its memory's yardstick: FP32 weights, gradients and
    AdamW's two moments."""
    return params * 4 * 4 / 2**20


def learner_memory(records) -> dict[str, float | None] | None:
    """The learner's highest resident peak, mapped shared memory and state (MB) over a run's metrics records (None
    for a key its records lack); None without a learner record carrying its memory."""
    steps = [r for r in records if r.get("role") == "learner" and "learner/peak_rss_mb" in r]
    if not steps:
        return None
    return {k: max((r[f"learner/{k}"] for r in steps if f"learner/{k}" in r), default=None)
            for k in ("peak_rss_mb", "shm_mb", "state_mb")}


def die_with_parent() -> None:
    """Every role calls this first: umask 077 (a run directory holds CURVE keys and weights), and it ends when the
    launcher dies, even by SIGKILL: the kernel's parent-death signal, and as a fallback (no prctl, or a wait that
    ignores the stop flag) a thread that sends SIGTERM itself and ``os._exit``\\ s after :data:`ORPHAN_GRACE_S`."""
    os.umask(0o077)
    sigterm_with_parent()  # without prctl the watchdog remains
    launcher = os.environ.get("DRIFTRL_LAUNCHER_PID")
    if not launcher:
        return  # started by hand, not by a launcher: nothing to watch
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before prctl took effect
    threading.Thread(target=_watch_launcher, args=(int(launcher),), name="orphan-watch", daemon=True).start()


def sigterm_with_parent() -> None:
    """SIGTERM when the parent dies, even by SIGKILL (Linux; a no-op without glibc's prctl, e.g. musl)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _watch_launcher(launcher: int) -> None:
    while os.getppid() == launcher:  # a dead parent's children are re-parented
        time.sleep(ORPHAN_POLL_S)
    log = logging.getLogger("driftrl.proc")
    log.warning("launcher %d is gone: stopping", launcher)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    log.error("still running %.0fs after the launcher died: exiting", ORPHAN_GRACE_S)
    os._exit(1)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def stop_event() -> threading.Event:
    """An Event set by SIGTERM/SIGINT, so loops end at a safe point."""
    ev = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: ev.set())
    return ev


def setup_logging(role: str) -> logging.Logger:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    return logging.getLogger(f"driftrl.{role}")
