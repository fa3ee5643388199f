"""Key-by-key books of a finished run whose buffer was never killed (it may have been stopped and
resumed): the buffer's store (``RUN_DIR/buffer/groups.sqlite``, every key it ever accepted) against
the learner's audit (``trained_keys.jsonl``) and the buffer's own counters -- its log (one start
line, requeue lines and one closing line per incarnation, exact) and ``metrics.jsonl`` (role
"buffer": the same counters, up to METRICS_EVERY_S behind).

Every accepted group ends in exactly one of:
  * trained: in one step of ``trained_keys.jsonl``, once, and the store says TRAINED (or DONE once
    a checkpoint covers it) at that very step;
  * resident: state RESIDENT, in no surviving step (it may be in ``trained_keys.rolled_back.jsonl``:
    a step cut by a learner restart, its groups served again);
  * retired: state DONE and in no surviving step. Only two ways are allowed here, both counted by the
    buffer: dropped as stale when sampled (``dropped {'stale': n}`` in its closing line) or dropped
    as rolled back when a restarted learner said which weights it holds (``... dropped as rolled
    back``, ``buffer/dropped_rolled_back``). The learner retires nothing in these runs (guard-rails
    warn only, the buffer filters staleness at the learner's own version): checked both from the
    learner's counters and from the buffer's consumed count, so "retired" hides nothing.
A buffer SIGKILLed mid-run may lose marks it had not committed yet (buffer/durable.py:
LAZY_COMMIT_S); its books do not balance this exactly, and this helper is not for such runs.
"""

from __future__ import annotations

import ast
import os
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass, field

from buffer import durable
from learner import audit
from tests.support.runs import lines

_START = re.compile(r"buffer listening on .*; (\d+) groups recovered")
_REQUEUE = re.compile(r"(\d+) groups trained after step (\d+) served again, (\d+) dropped as rolled back")
_CLOSE = re.compile(r"buffer closing: accepted (\d+), consumed (\d+), dropped (\{[^}]*\}), resident (\d+),")
LEARNER_RETIRES = ("dropped_stale", "dropped_rolled_back", "dropped_invalid", "skipped_batches")


@dataclass
class Incarnation:
    """One buffer process, from its log."""
    loaded: int  # resident groups it loaded from the store at start
    served_again: int = 0  # groups trained after a restarted learner's step, resident again
    rolled_back: int = 0  # ... and those dropped instead (sampled by weights that no longer exist)
    accepted: int | None = None  # the closing line's counters (None: it never closed)
    consumed: int = 0
    dropped: dict = field(default_factory=dict)
    resident: int = 0


def buffer_incarnations(run_dir: str) -> list[Incarnation]:
    incs: list[Incarnation] = []
    with open(os.path.join(run_dir, "logs", "buffer.log")) as f:
        for line in f:
            if m := _START.search(line):
                incs.append(Incarnation(int(m.group(1))))
            elif m := _REQUEUE.search(line):
                incs[-1].served_again += int(m.group(1))
                incs[-1].rolled_back += int(m.group(3))
            elif m := _CLOSE.search(line):
                inc = incs[-1]
                inc.accepted, inc.consumed, inc.resident = int(m.group(1)), int(m.group(2)), int(m.group(4))
                inc.dropped = ast.literal_eval(m.group(3))
    return incs


def store_rows(run_dir: str) -> dict[tuple[str, int], tuple[int, int | None, bool]]:
    """Every key the store ever accepted -> (state, step, its bytes still held)."""
    db = sqlite3.connect(os.path.join(run_dir, "buffer", durable.FILE))
    try:
        return {(a, q): (state, step, raw is not None)
                for a, q, state, step, raw in db.execute("SELECT actor, seq, state, step, raw FROM groups")}
    finally:
        db.close()


def check(run_dir: str, steps: int, split_at: tuple[float, ...] = ()) -> dict:
    """Assert the books of a run that trained steps 1..``steps`` (see the module docstring);
    ``split_at``: the times between the buffer's incarnations (its metrics records carry no pid).
    Returns the counts, for the test's output."""
    # the audit: steps 1..N, each version once and rising, no key twice
    kept = audit.read(os.path.join(run_dir, audit.TRAINED))
    cut = audit.read(os.path.join(run_dir, audit.ROLLED_BACK))
    assert [s["step"] for s in kept] == list(range(1, steps + 1)), [s["step"] for s in kept]
    versions = [s["version"] for s in kept]
    assert versions == sorted(set(versions)), versions
    assert not set(versions) & {s["version"] for s in cut}, "a rolled-back step's version was published again"
    trained_list = [(tuple(k), s["step"]) for s in kept for k in s["keys"]]
    twice = sorted(k for k, n in Counter(k for k, _ in trained_list).items() if n > 1)
    assert not twice, f"trained more than once: {twice[:10]}"
    trained = dict(trained_list)
    cut_keys = {tuple(k) for s in cut for k in s["keys"]}

    # key by key: the store against the audit
    rows = store_rows(run_dir)
    assert not set(trained) - set(rows), f"trained, never accepted: {sorted(set(trained) - set(rows))[:10]}"
    assert not cut_keys - set(rows), f"trained in a cut step, never accepted: {sorted(cut_keys - set(rows))[:10]}"
    resident, retired = set(), set()
    for key, (state, step, held) in rows.items():
        assert held == (state != durable.DONE), (key, state, held)  # DONE forgets the bytes, only DONE
        if key in trained:  # the store marked it at the step that trained it
            assert state in (durable.TRAINED, durable.DONE) and step == trained[key], (key, state, step, trained[key])
        elif state == durable.RESIDENT:
            resident.add(key)
        else:
            assert state == durable.DONE, f"{key} marked trained at step {step}, trained in no surviving step"
            retired.add(key)
    assert len(rows) == len(trained) + len(resident) + len(retired)

    # the buffer's own counts, per incarnation, from its log (exact: the closing line is its last word)
    incs = buffer_incarnations(run_dir)
    assert incs and all(i.accepted is not None for i in incs), f"a buffer incarnation did not close: {incs}"
    for i, inc in enumerate(incs):
        assert inc.accepted == inc.consumed + sum(inc.dropped.values()) + inc.resident, inc  # its invariant
        assert set(inc.dropped) <= {"stale"}, inc.dropped
        if i:  # what one incarnation left resident is what the next one loaded
            assert inc.loaded == incs[i - 1].resident, (incs[i - 1], inc)
    assert incs[0].loaded == 0
    # accepted counts the groups recovered (loaded, served again) besides the new ones: one row each
    assert sum(i.accepted - i.loaded - i.served_again for i in incs) == len(rows), (incs, len(rows))
    assert incs[-1].resident == len(resident), (incs[-1], len(resident))
    stale = sum(i.dropped.get("stale", 0) for i in incs)
    rolled_back = sum(i.rolled_back for i in incs)
    served_again = sum(i.served_again for i in incs)
    # consumed = the trained (one each) + those trained in a cut step (each served again or dropped
    # as rolled back) + whatever the learner retired: nothing here
    learner_retired = sum(i.consumed for i in incs) - len(trained) - served_again - rolled_back
    assert learner_retired == 0, (learner_retired, incs, len(trained))
    assert len(retired) == stale + rolled_back, (len(retired), stale, rolled_back)
    assert rolled_back <= len(retired & cut_keys)  # a rolled-back group was trained in a cut step

    recs = lines(os.path.join(run_dir, "metrics.jsonl"))
    for r in recs:  # the learner's side says the same: it retired nothing
        if r["role"] == "learner":
            assert not any(r.get(f"learner/{k}", 0.0) for k in LEARNER_RETIRES), r

    # the buffer's metrics, per incarnation: the same counts. Its last record may lag the closing line
    # by up to METRICS_EVERY_S (it writes none on stopping, and actors are stopped just before it): its
    # counters can only be behind, never ahead; what moves only when a learner says Hello is exact
    buf = [r for r in recs if r["role"] == "buffer" and "buffer/invariant_ok" in r]
    bounds = (float("-inf"), *split_at, float("inf"))
    for i, inc in enumerate(incs):
        part = [r for r in buf if bounds[i] <= r["time"] < bounds[i + 1]]
        assert part, f"no metrics from buffer incarnation {i}"
        assert all(r["buffer/invariant_ok"] == 1.0 for r in part), "the buffer reported its invariant broken"
        last = part[-1]
        assert last["buffer/recovered"] == inc.loaded + inc.served_again, (last, inc)
        assert last["buffer/dropped_rolled_back"] == inc.rolled_back, (last, inc)
        dropped = last["buffer/accepted"] - last["buffer/consumed"] - last["buffer/depth"]  # its invariant
        final = (last["buffer/accepted"], last["buffer/consumed"], dropped)
        close = (inc.accepted, inc.consumed, sum(inc.dropped.values()))
        assert all(a <= b for a, b in zip(final, close)), (final, close)
    return {"accepted": len(rows), "trained": len(trained), "resident": len(resident), "retired": len(retired),
            "dropped_stale": stale, "dropped_rolled_back": rolled_back, "served_again": served_again,
            "steps_cut": len(cut), "buffer_incarnations": len(incs)}
