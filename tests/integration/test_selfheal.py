"""Self-healing on real processes, under the local and the Ray launcher: an actor, then the
buffer, then the learner are SIGKILLed mid-run; each comes back within a bounded time, the run
completes, nothing is trained twice and every group the buffer accepted is accounted for (trained,
dropped, or still resident). And a role that hangs (SIGSTOP) is found by its silent heartbeat,
killed and restarted. And the learner alone, SIGKILLed twice in one run: key by key, every group the
buffer acknowledged is trained exactly once, still resident, or dropped and counted (tests/support/books.py)."""

import json
import logging
import os
import re
import signal
import sqlite3
import threading
import time

import pytest

from buffer import durable
from core import config as C
from core import heartbeat
import jobs
from learner import audit
from tests.support import books
from tests.support.runs import TINY_RUN, alive, lines, models_dir, read_json, wait_until

KILLS = ("actor0", "buffer", "learner")  # in this order, each after PROGRESS more trained steps
PROGRESS = 3
STEPS = 25  # the kill runs' step budget: their last kill lands near step 10, the rest is trained after it
BACK_S = 60.0  # a killed role must be running (new pid) and beating again within this
RESUMED = re.compile(r"resumed from (\S+) at step (\d+) version (\d+) \(checkpoint version (\d+)\)")


@pytest.fixture(scope="module")
def cache_dir():
    return models_dir()  # the tiny model, built once for all the whole-run tests


def _pid(run_dir: str, name: str) -> int | None:
    return (read_json(os.path.join(run_dir, "pids.json")) or {}).get(name)  # rewritten on every restart


def _kill_in_turn(run_dir: str, procs: list, back: dict) -> None:
    """SIGKILL each role of KILLS after the run made progress; record how long it took to be back.
    Under Ray the actor goes with its host actor (``ray.kill``: what a lost node does to it)."""
    trained = os.path.join(run_dir, "trained_keys.jsonl")
    for name in KILLS:
        target = len(lines(trained)) + PROGRESS
        if not wait_until(lambda: len(lines(trained)) >= target, 120):
            return
        pid, beat = _pid(run_dir, name), heartbeat.mtime(run_dir, name)
        t0 = time.monotonic()
        host = getattr(next(r for r in procs if r.name == name).handle, "host", None)
        if host is not None and name.startswith("actor"):
            import ray

            ray.kill(host)
        else:
            os.kill(pid, signal.SIGKILL)
        ok = wait_until(lambda: _pid(run_dir, name) not in (None, pid) and heartbeat.mtime(run_dir, name) != beat
                   and not alive(pid), BACK_S)
        back[name] = time.monotonic() - t0 if ok else None


def _buffer_books(run_dir: str) -> dict:
    """What the buffer's store tells after the run: every key it ever accepted -> its state."""
    db = sqlite3.connect(os.path.join(run_dir, "buffer", durable.FILE))
    try:
        return {(a, q): state for a, q, state in db.execute("SELECT actor, seq, state FROM groups")}
    finally:
        db.close()


def _assert_resumed_at_its_checkpoint(rd: str, steps: list[dict]) -> None:
    with open(os.path.join(rd, "logs", "learner.log")) as f:
        m = RESUMED.search(f.read())
    assert m, "the learner did not say it resumed from a checkpoint"
    ckpt, step, ck_version = m.group(1), int(m.group(2)), int(m.group(4))
    assert os.path.basename(ckpt) == f"step_{step:06d}" and step >= PROGRESS
    assert next(s["version"] for s in steps if s["step"] == step) == ck_version  # the version it had then


def _assert_every_accepted_group_accounted_for(rd: str, recs: list[dict], trained: set) -> None:
    """accepted = consumed + dropped + resident in the buffer's last report, and key by key: every
    accepted group trained (once: the audit), still resident, or retired unused; a group is kept as
    trained only for a step the audit lists (a rolled-back step's groups were served again)."""
    last = [r for r in recs if r["role"] == "buffer" and "buffer/invariant_ok" in r][-1]
    assert last["buffer/invariant_ok"] == 1.0
    books = _buffer_books(rd)
    resident = {k for k, state in books.items() if state == durable.RESIDENT}
    assert trained <= set(books)  # nothing trained that was never accepted
    assert len(resident) == last["buffer/depth"] and not resident & trained
    assert {k for k, state in books.items() if state == durable.TRAINED} <= trained


def _config(cache_dir: str, launcher: str, *extra: str) -> C.Config:
    return C.load(None, TINY_RUN + [f"model.cache_dir={cache_dir}", f"run.launcher={launcher}",
                                    "run.restart_backoff_s=0.2", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_actor_buffer_and_learner_killed_in_turn_all_heal(tmp_path, cache_dir, launcher):
    if launcher == "ray":
        pytest.importorskip("ray")
    # enough steps that the last kill lands mid-run, not in the final save: the learner steps of
    # this tiny model take ~0.1 s, and a run that ends before the killed role is back is no test
    cfg = _config(cache_dir, launcher, "buffer.max_staleness=1", "run.ckpt_every=3", f"run.max_steps={STEPS}",
                  "run.max_time_s=200")
    back: dict = {}

    def on_ready(run_dir, procs):
        threading.Thread(target=_kill_in_turn, args=(run_dir, procs, back), daemon=True).start()

    result = jobs.train(cfg, str(tmp_path / "run"), on_ready=on_ready)
    rd = result.run_dir
    assert set(back) == set(KILLS), f"the run did not progress past each kill: {back}"
    assert all(s is not None for s in back.values()), f"not back within {BACK_S}s: {back}"
    assert not result.interrupted and result.returncodes["learner"] == 0
    print(f"selfheal[{launcher}] back after (s): " + ", ".join(f"{n} {t:.1f}" for n, t in back.items()))

    recs = lines(os.path.join(rd, "metrics.jsonl"))
    for name in KILLS:
        counts = [r[f"run/restarts/{name}"] for r in recs if f"run/restarts/{name}" in r]
        assert counts == [1.0], (name, counts)
    steps = lines(os.path.join(rd, "trained_keys.jsonl"))
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    trained = [tuple(k) for s in steps for k in s["keys"]]
    assert len(trained) == len(set(trained))  # no key trained twice
    versions = [s["version"] for s in steps]
    rolled = lines(os.path.join(rd, "trained_keys.rolled_back.jsonl"))
    assert versions == sorted(set(versions))  # monotonic, none published twice
    assert not set(versions) & {s["version"] for s in rolled}  # a rolled-back version is never reused

    _assert_resumed_at_its_checkpoint(rd, steps)
    _assert_every_accepted_group_accounted_for(rd, recs, set(trained))
    with open(os.path.join(rd, "pids.json")) as f:
        assert not any(alive(pid) for name, pid in json.load(f).items() if name != "launcher")


def _kill_learner_twice(run_dir: str, kills: list) -> None:
    """SIGKILL the learner once it trained past a checkpoint (ckpt_every=3), then again once its next
    incarnation is back and trained PROGRESS + 2 steps beyond the first kill (so past a newer
    checkpoint too). Each kill appends {"step": newest audited step just before, "back_s": ...}."""
    path = os.path.join(run_dir, audit.TRAINED)

    def top() -> int:  # audit.read: a line being appended right now is not a step yet
        return max((s["step"] for s in audit.read(path)), default=0)

    target = PROGRESS + 2
    for _ in range(2):
        if not wait_until(lambda: top() >= target, 180):
            return
        pid, beat, at = _pid(run_dir, "learner"), heartbeat.mtime(run_dir, "learner"), top()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        ok = wait_until(lambda: _pid(run_dir, "learner") not in (None, pid) and
                   heartbeat.mtime(run_dir, "learner") != beat and not alive(pid), BACK_S)
        kills.append({"step": at, "back_s": time.monotonic() - t0 if ok else None})
        if not ok:
            return
        target = at + PROGRESS + 2


@pytest.mark.slow
def test_learner_killed_twice_every_acknowledged_group_trained_once(tmp_path, cache_dir):
    """Local launcher only. The learner restarts from its newest checkpoint each time (a later one the
    second time), the steps it trained since are cut from the audit and their groups served again
    (or dropped as stale / rolled back: counted), and the books balance key by key."""
    cfg = _config(cache_dir, "local", "buffer.max_staleness=1", "run.ckpt_every=3", f"run.max_steps={STEPS}",
                  "run.max_time_s=400")
    kills: list = []

    def on_ready(run_dir, procs):
        threading.Thread(target=_kill_learner_twice, args=(run_dir, kills), daemon=True).start()

    result = jobs.train(cfg, str(tmp_path / "run"), on_ready=on_ready)
    rd = result.run_dir
    assert len(kills) == 2, f"the run did not progress past each kill: {kills}"
    assert all(k["back_s"] is not None for k in kills), f"not back within {BACK_S}s: {kills}"
    assert not result.interrupted and result.returncodes["learner"] == 0

    recs = lines(os.path.join(rd, "metrics.jsonl"))
    assert [r["run/restarts/learner"] for r in recs if "run/restarts/learner" in r] == [1.0, 2.0]
    assert not [k for r in recs for k in r if k.startswith("run/restarts/") and k != "run/restarts/learner"]

    steps = audit.read(os.path.join(rd, audit.TRAINED))
    with open(os.path.join(rd, "logs", "learner.log")) as f:
        resumed = RESUMED.findall(f.read())
    assert len(resumed) == 2, resumed  # once per restart, each from a checkpoint
    ckpt_steps = []
    for (ckpt, step, _, ck_version), kill in zip(resumed, kills):
        step, ck_version = int(step), int(ck_version)
        assert os.path.basename(ckpt) == f"step_{step:06d}" and PROGRESS <= step <= kill["step"] + 1, (ckpt, kill)
        assert next(s["version"] for s in steps if s["step"] == step) == ck_version  # the version it had then
        ckpt_steps.append(step)
    assert ckpt_steps[0] < ckpt_steps[1], ckpt_steps  # the second incarnation checkpointed before its death

    # exactly the steps after each restart's checkpoint, up to the death, were cut from the audit
    cut = [s["step"] for s in audit.read(os.path.join(rd, audit.ROLLED_BACK))]
    ends = [(k["step"], k["step"] + 1) for k in kills]  # a step may land between the last look and the kill
    assert cut in [list(range(ckpt_steps[0] + 1, a + 1)) + list(range(ckpt_steps[1] + 1, b + 1))
                   for a in ends[0] for b in ends[1]], (cut, ckpt_steps, kills)
    counts = books.check(rd, STEPS)
    back = ", ".join(f"{k['back_s']:.1f}" for k in kills)
    print(f"learner killed at steps {[k['step'] for k in kills]}, back after {back} s, "
          f"resumed at {ckpt_steps}; books: {counts}")
    with open(os.path.join(rd, "pids.json")) as f:
        assert not any(alive(pid) for name, pid in json.load(f).items() if name != "launcher")


@pytest.mark.slow
def test_a_hung_actor_is_killed_and_restarted(tmp_path, cache_dir, caplog):
    """SIGSTOP the actor: its heartbeat stops, the launcher SIGKILLs it as hung and restarts it."""
    cfg = _config(cache_dir, "local", "run.heartbeat_timeout_s=6", "run.max_steps=8", "run.max_time_s=150")
    stopped: dict = {}

    def on_ready(run_dir, procs):
        def work():
            trained = os.path.join(run_dir, "trained_keys.jsonl")
            if wait_until(lambda: len(lines(trained)) >= 2, 90):
                stopped["pid"] = pid = _pid(run_dir, "actor0")
                os.kill(pid, signal.SIGSTOP)
                t0 = time.monotonic()
                if wait_until(lambda: _pid(run_dir, "actor0") not in (None, pid), 60):
                    stopped["back_s"] = time.monotonic() - t0
        threading.Thread(target=work, daemon=True).start()

    with caplog.at_level(logging.WARNING, logger="driftrl.launch"):
        result = jobs.train(cfg, str(tmp_path / "run"), on_ready=on_ready)
    assert "back_s" in stopped, f"the stopped actor was not replaced: {stopped}"
    # not before the timeout (less the beat that may have come just before the stop), well within 40 s
    assert 6.0 - heartbeat.BEAT_EVERY_S - 0.5 <= stopped["back_s"] < 40.0, stopped
    assert result.returncodes["learner"] == 0 and not alive(stopped["pid"])
    assert any("actor0 hung: no heartbeat for" in r.getMessage() for r in caplog.records)
    recs = lines(os.path.join(result.run_dir, "metrics.jsonl"))
    assert [r["run/restarts/actor0"] for r in recs if "run/restarts/actor0" in r] == [1.0]
