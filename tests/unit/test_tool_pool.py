"""The reward pool running tools: ``call`` returns each payload's text in order, and a tool that hangs,
burns CPU, allocates too much or reaches for the network (inside a :class:`Sandbox`) gives None and is
counted, while the pool keeps serving."""

import socket
import time
from contextlib import closing

from actor.rewards import RewardPool, Sandbox

TOOL = "tests.support.tools:scripted"
COUNTERS = ("tool/calls", "tool/timeouts", "tool/errors")


def _pool(timeout_s=10.0, sandbox=None) -> RewardPool:
    return RewardPool(TOOL, 1, timeout_s, counters=COUNTERS, sandbox=sandbox)


def _upper(text):
    return {"op": "upper", "text": text}


def _pid(pool) -> int:
    return pool._workers[0].proc.pid


def test_call_returns_text_in_order_and_counts_under_the_given_names():
    with closing(_pool()) as pool:
        words = ["alpha", "beta", "", "gamma"]
        assert pool.call([_upper(w) for w in words]) == ["ALPHA", "BETA", "", "GAMMA"]
        assert pool.call([]) == []
        assert pool.counts == {"tool/calls": 4.0, "tool/timeouts": 0.0, "tool/errors": 0.0}


def test_a_number_is_not_text_and_text_is_not_a_score():
    with closing(_pool()) as pool:
        assert pool.call([{"op": "number"}, _upper("a")]) == [None, "A"]
        assert pool.score([_upper("a"), {"op": "number"}]) == [0.0, 1.0]
        assert pool.counts == {"tool/calls": 2.0, "tool/timeouts": 0.0, "tool/errors": 2.0}


def test_a_sleeping_tool_is_killed_at_the_deadline_and_replaced():
    with closing(_pool(timeout_s=0.5)) as pool:
        before = _pid(pool)
        t0 = time.monotonic()
        assert pool.call([_upper("a"), {"op": "sleep"}, _upper("b")]) == ["A", None, "B"]
        assert time.monotonic() - t0 < 5.0
        assert pool.counts["tool/timeouts"] == 1.0 and pool.counts["tool/errors"] == 0.0
        assert _pid(pool) != before and pool.call([_upper("c")]) == ["C"]


def test_a_spinning_tool_is_killed_by_its_cpu_limit_long_before_the_deadline():
    with closing(_pool(timeout_s=30.0, sandbox=Sandbox(cpu_s=1))) as pool:
        before = _pid(pool)
        t0 = time.monotonic()
        assert pool.call([{"op": "spin"}]) == [None]
        assert time.monotonic() - t0 < 10.0
        assert pool.counts["tool/errors"] == 1.0 and pool.counts["tool/timeouts"] == 0.0
        assert _pid(pool) != before
        assert pool.call([_upper("a"), _upper("b")]) == ["A", "B"]  # each call has its own CPU budget


def test_an_allocation_over_the_memory_cap_fails_and_the_worker_stays():
    with closing(_pool(sandbox=Sandbox(memory_mb=256))) as pool:
        before = _pid(pool)
        assert pool.call([{"op": "alloc"}]) == [None]
        assert pool.counts["tool/errors"] == 1.0
        assert pool.call([_upper("a")]) == ["A"] and _pid(pool) == before


def test_the_network_is_off_unless_the_sandbox_allows_it():
    with socket.create_server(("127.0.0.1", 0)) as server:
        connect = {"op": "connect", "port": server.getsockname()[1]}
        with closing(_pool(sandbox=Sandbox())) as pool:
            assert pool.call([connect]) == [None]
            assert pool.counts["tool/errors"] == 1.0
        with closing(_pool(sandbox=Sandbox(network=True))) as pool:
            assert pool.call([connect]) == ["connected"]
