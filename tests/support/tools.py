"""Tool-pool test tools (tests/unit/test_tool_pool.py): the payload says how the call behaves::

    {"op": "upper", "text": "a"}  -> "A"          {"op": "sleep"} -> never returns (no CPU)
    {"op": "spin"}                -> busy forever  {"op": "alloc"} -> allocates 2 GiB
    {"op": "connect", "port": p}  -> "connected" once a TCP connection to 127.0.0.1:p is made
    {"op": "pid"}                 -> the worker's pid   {"op": "number"} -> 1.0 (not text)
"""

from __future__ import annotations

import os
import socket
import time


def scripted(payload: dict):
    op = payload["op"]
    if op == "sleep":
        while True:
            time.sleep(3600)
    if op == "spin":  # burns CPU until the sandbox's per-call CPU limit kills the worker
        while True:
            sum(range(10_000))
    if op == "alloc":
        return f"allocated {len(bytearray(2 << 30))} bytes"
    if op == "connect":
        socket.create_connection(("127.0.0.1", payload["port"]), timeout=1).close()
        return "connected"
    if op == "pid":
        return str(os.getpid())
    if op == "number":
        return 1.0
    return payload["text"].upper()


def slow_calc(call: str) -> str:
    """The calculator, except that a call with a 9 in it never returns (tests/unit/test_episodes.py)."""
    from actor.tasks.calc import calculator

    while "9" in call:
        time.sleep(3600)
    return calculator(call)
