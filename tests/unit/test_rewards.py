"""The reward pool: answers are checked in real worker processes; a hung checker is killed within
its timeout and replaced, a crash or a raising checker scores 0 and is counted, and no worker
outlives the pool or its parent process."""

import subprocess
import sys
import time
from collections import deque
from contextlib import closing

import pytest

from actor.rewards import MAX_FRAME_BYTES, RewardPool, ScoreRequest, frame
from tests.support.runs import ROOT, alive

SCRIPTED = "tests.support.scorers:scripted"


def _ok(v):
    return {"op": "ok", "value": v}


def _pids(pool, n=None):
    """The pids of the workers that answered ``n`` (default: two per worker) pid checks."""
    return {int(p) for p in pool.score([{"op": "pid"}] * (n or 2 * len(pool._workers)))}


def _gone(pids, within_s=10.0) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_scores_come_back_in_order_and_are_counted():
    with closing(RewardPool(SCRIPTED, 2, timeout_s=10.0)) as pool:
        values = [i / 10 for i in range(12)]
        assert pool.score([_ok(v) for v in values]) == values
        assert pool.score([]) == []
        assert pool.counts == {"reward/checks": 12.0, "reward/timeouts": 0.0, "reward/errors": 0.0}
        assert len(_pids(pool, 20)) == 2  # both workers took answers


def test_a_hanging_checker_is_killed_within_its_timeout_and_replaced():
    timeout = 1.0
    with closing(RewardPool(SCRIPTED, 2, timeout_s=timeout)) as pool:
        before = _pids(pool)
        t0 = time.monotonic()
        out = pool.score([_ok(0.25), {"op": "hang"}, _ok(0.5), _ok(0.75), _ok(1.0)])
        elapsed = time.monotonic() - t0
        assert out == [0.25, 0.0, 0.5, 0.75, 1.0]
        assert timeout <= elapsed < timeout + 5.0  # the other answers went on meanwhile
        assert pool.counts["reward/timeouts"] == 1.0 and pool.counts["reward/errors"] == 0.0
        now = {w.proc.pid for w in pool._workers}
        assert len(now) == 2 and len(now - before) == 1  # one replacement took over
        assert _gone(before - now)  # the hung one was killed, not left behind
        assert pool.score([_ok(0.5)] * 4) == [0.5] * 4 and _pids(pool, 20) <= now


def test_a_raising_or_nan_checker_scores_zero_and_the_worker_stays():
    with closing(RewardPool(SCRIPTED, 1, timeout_s=10.0)) as pool:
        before = _pids(pool)
        assert pool.score([{"op": "raise"}, _ok(1.0), {"op": "nan"}, _ok(0.5)]) == [0.0, 1.0, 0.0, 0.5]
        assert pool.counts == {"reward/checks": 2.0 + len(before) * 2, "reward/timeouts": 0.0,
                                  "reward/errors": 2.0}
        assert _pids(pool) == before


def test_a_crashing_checker_is_counted_and_its_worker_replaced():
    with closing(RewardPool(SCRIPTED, 1, timeout_s=10.0)) as pool:
        before = _pids(pool)
        assert pool.score([_ok(0.5), {"op": "exit"}, _ok(1.0)]) == [0.5, 0.0, 1.0]
        assert pool.counts["reward/errors"] == 1.0 and pool.counts["reward/timeouts"] == 0.0
        assert _pids(pool).isdisjoint(before)


def test_a_chatty_checker_does_not_break_the_protocol():
    with closing(RewardPool(SCRIPTED, 1, timeout_s=10.0)) as pool:
        assert pool.score([{"op": "print", "value": 0.5}, _ok(1.0)]) == [0.5, 1.0]


def test_an_oversized_payload_scores_zero_without_being_sent():
    with closing(RewardPool(SCRIPTED, 1, timeout_s=10.0)) as pool:
        before = _pids(pool)
        big = {"op": "ok", "value": 1.0, "pad": "x" * (MAX_FRAME_BYTES + 1)}
        assert pool.score([big, _ok(0.5)]) == [0.0, 0.5]
        assert pool.counts["reward/errors"] == 1.0 and _pids(pool) == before


@pytest.mark.parametrize("spec,match", [("tests.support.scorers:nope", "has no function 'nope'"),
                                        ("tests.support.no_such_module:f", "No module named"),
                                        ("no-colon", "not of the form 'module:function'")])
def test_a_scorer_that_cannot_load_is_a_clear_error(spec, match):
    with pytest.raises(RuntimeError, match=match):
        RewardPool(spec, 2, timeout_s=1.0)


def test_close_is_idempotent_and_final():
    pool = RewardPool(SCRIPTED, 1, timeout_s=1.0)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.score([_ok(1.0)])


def test_close_stops_every_worker_even_a_hung_one():
    pool = RewardPool(SCRIPTED, 2, timeout_s=30.0)
    pids = _pids(pool)
    pool._dispatch(deque([(0, frame(ScoreRequest(0, {"op": "hang"})))]))  # one worker busy for good
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 10.0
    assert _gone(pids, within_s=1.0)


PARENT = """
import os, sys, threading, time
from actor.rewards import RewardPool
pool = RewardPool("tests.support.scorers:scripted", 2, timeout_s=60.0)
print(" ".join(str(int(p)) for p in pool.score([{"op": "pid"}] * 8)), flush=True)
threading.Timer(0.5, os._exit, (0,)).start()  # the parent dies while a worker is stuck in a check
pool.score([{"op": "hang"}, {"op": "ok", "value": 1.0}])
"""


def test_workers_do_not_outlive_a_parent_that_dies():
    out = subprocess.run([sys.executable, "-c", PARENT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    pids = {int(p) for p in out.stdout.split()}
    assert len(pids) == 2, out.stderr
    assert _gone(pids)
