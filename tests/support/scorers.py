"""Reward-pool test scorers: each payload says how its check behaves, so one pool can meet a
good answer, a hang, a crash and a raising checker in one batch (tests/unit/test_rewards.py)::

    {"op": "ok", "value": 0.5}   -> 0.5            {"op": "raise"} -> ValueError
    {"op": "hang"}               -> never returns  {"op": "exit"}  -> os._exit(3): the worker dies
    {"op": "nan"}                -> NaN            {"op": "pid"}   -> the worker's pid
    {"op": "print", "value": 1}  -> prints to stdout first (must not break the protocol)

:func:`hang_once_then_math` is the integration tests' planted checker (through
tests/support/patched_actor.py ``--scorer``): the first answer any of the run's workers sees hangs -- claimed
atomically through the file named by ``DRIFTRL_TEST_HANG_MARKER`` -- and every other answer is
scored by the real math-verify scorer.
"""

from __future__ import annotations

import os
import time

HANG_MARKER_ENV = "DRIFTRL_TEST_HANG_MARKER"


def _hang() -> None:
    while True:
        time.sleep(3600)


def scripted(payload: dict) -> float:
    op = payload["op"]
    if op == "hang":
        _hang()
    if op == "raise":
        raise ValueError("the checker broke on this answer")
    if op == "exit":
        os._exit(3)
    if op == "nan":
        return float("nan")
    if op == "pid":
        return float(os.getpid())
    if op == "print":
        print("a chatty checker " * 100, flush=True)
    return float(payload["value"])


def hang_once_then_math(payload: dict) -> float:
    from actor.tasks.mathfile import score

    try:
        fd = os.open(os.environ[HANG_MARKER_ENV], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return score(payload)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    _hang()
    return 0.0


def warmup() -> None:
    """Load math-verify as the real math scorer's warm-up does (the planted checker delegates to it)."""
    if os.environ.get(HANG_MARKER_ENV):
        from actor.tasks.mathfile import warmup as math_warmup

        math_warmup()
