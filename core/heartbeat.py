"""Heartbeats: each role touches ``run_dir/heartbeat/<role>`` from its loop (at most once a second). The launcher only
asks whether the file's mtime changed since it last looked, timed on its own clock, so a host's skewed clock never
matters. Before its first beat a role gets START_GRACE_S."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

BEAT_EVERY_S = 1.0
START_GRACE_S = 60.0  # before a role's first beat: a model load may outlast a short timeout
BACKOFF_CAP_S = 30.0
_last: dict[str, float] = {}
_role: tuple[str, str] | None = None  # (run_dir, role) of this process's last beat: see pulse()


def path(run_dir: str, role: str) -> str:
    return os.path.join(run_dir, "heartbeat", role)


def beat(run_dir: str, role: str) -> None:
    global _role
    if not run_dir:
        return
    _role = (run_dir, role)
    p, now = path(run_dir, role), time.monotonic()
    if now - _last.get(p, -BEAT_EVERY_S) < BEAT_EVERY_S:
        return
    _last[p] = now
    try:
        os.utime(p)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "ab").close()


def pulse() -> None:
    """A beat for this process's role from inside long work (a micro-batch, a checkpoint file): a
    slow step is progress, not a hang. Nothing before the role's loop has beaten once."""
    if _role is not None:
        beat(*_role)


def mtime(run_dir: str, role: str) -> float | None:
    """None before the role's first beat ever."""
    try:
        return os.stat(path(run_dir, role)).st_mtime_ns / 1e9
    except FileNotFoundError:
        return None


@dataclass
class Watch:
    stamp: float | None  # the file's mtime when last looked at (its value, never compared to now)
    seen_at: float  # launcher clock: the spawn, or when ``stamp`` last changed
    beaten: bool = False  # the file moved since the spawn (a previous incarnation's beat does not count)


def observe(w: Watch, stamp: float | None, now: float) -> Watch:
    return Watch(stamp, now, True) if stamp != w.stamp else w


def hung_for(w: Watch, now: float, timeout_s: float) -> float | None:
    """Seconds without a beat when that is past the allowance (None otherwise, or when off)."""
    quiet, allowance = now - w.seen_at, timeout_s if w.beaten else max(timeout_s, START_GRACE_S)
    return quiet if timeout_s > 0 and quiet > allowance else None


def backoff_s(base_s: float, n: int) -> float:
    """The delay before the ``n``-th restart of a role (n >= 1): base * 2^(n-1), capped."""
    if n < 1:
        raise ValueError(f"restart number n = {n} must be at least 1")
    return min(base_s * 2.0 ** (n - 1), BACKOFF_CAP_S)
