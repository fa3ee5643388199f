"""Process plumbing shared by every role: parent-death signal, signal-driven stop flag, logging."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to signal us when the launcher dies, even by SIGKILL (Linux only)."""
    if sys.platform.startswith("linux"):
        # without glibc (e.g. musl) there is no prctl; the launcher's stop_all still reaps us
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    launcher = os.environ.get("DRIFTRL_LAUNCHER_PID")
    if launcher and os.getppid() != int(launcher):
        # the launcher died before prctl took effect
        os.kill(os.getpid(), sig)


def stop_event() -> threading.Event:
    """An Event set by SIGTERM/SIGINT, so loops end at a safe point instead of mid-step."""
    ev = threading.Event()

    def _handler(signum, frame):
        ev.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return ev


def setup_logging(role: str, level: int = logging.INFO) -> logging.Logger:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    return logging.getLogger(f"driftrl.{role}")
