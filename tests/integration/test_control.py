"""Guard-rails and the adaptive staleness limit acting in real runs (real launcher, processes and
sockets) on an injected mismatch: the actors run patched (tests/support/patched_actor.py ``--skew``)
to sample the batches they start at some versions at 3x the temperature while the learner's
numerator keeps the configured one.

On the tiny model a clean step's ratio p99 is ~1.01 and its min ~0.98, while a skewed one's are
~2.7-3.6 and ~0.22 (measured on this run's settings); the thresholds below sit in between with
a wide margin on both sides."""

import json
import os
import re

import pytest

from core import config as C
import jobs
from tests.support import patched_actor
from tests.support.runs import TINY_RUN, alive, lines, models_dir

pytestmark = pytest.mark.slow
GUARDS = ["control.guard_ratio_p99=1.5", "control.guard_ratio_min=0.5"]


@pytest.fixture(scope="module")
def cache_dir():
    return models_dir()  # the tiny model, built once for all the whole-run tests


def _train(tmp_path, cache_dir, monkeypatch, skew: str, *overrides):
    patched_actor.use(monkeypatch, "--skew", skew)
    cfg = C.load(None, TINY_RUN + [f"model.cache_dir={cache_dir}", "run.max_time_s=80", *overrides])
    result = jobs.train(cfg, str(tmp_path / "run"))
    assert not result.interrupted and result.returncodes["learner"] == 0
    return result.run_dir


def _log(run_dir, role):
    with open(os.path.join(run_dir, "logs", f"{role}.log")) as f:
        return f.read()


def _skewed_keys(run_dir) -> set:
    """The groups the actor's hook sampled skewed (it logs each one)."""
    found = re.findall(r"group \['(\w+)', (\d+)\] sampled at temperature", _log(run_dir, "actor0"))
    return {(a, int(s)) for a, s in found}


def _learner_records(run_dir):
    return [r for r in lines(os.path.join(run_dir, "metrics.jsonl")) if r["role"] == "learner"]


def _books_balance(run_dir, steps: int):
    """Every step trained once, versions monotonic, no key twice, the buffer's invariant, no role left."""
    trained = lines(os.path.join(run_dir, "trained_keys.jsonl"))
    assert [s["step"] for s in trained] == list(range(1, steps + 1))
    versions = [s["version"] for s in trained]
    assert versions == sorted(set(versions))
    keys = [tuple(k) for s in trained for k in s["keys"]]
    assert len(keys) == len(set(keys))
    buf = [r for r in lines(os.path.join(run_dir, "metrics.jsonl")) if "buffer/invariant_ok" in r]
    assert buf and buf[-1]["buffer/invariant_ok"] == 1.0
    with open(os.path.join(run_dir, "pids.json")) as f:
        assert not any(alive(pid) for name, pid in json.load(f).items() if name != "launcher")
    return trained, set(keys)


def test_pause_actors_fires_on_the_injected_mismatch_and_the_run_finishes(tmp_path, cache_dir, monkeypatch):
    rd = _train(tmp_path, cache_dir, monkeypatch, "4:5:3.0", "run.max_steps=20", *GUARDS,
                "control.guard_action=pause_actors", "control.pause_steps=2")
    assert _skewed_keys(rd), "the hook never fired"
    learner = _log(rd, "learner")
    assert re.search(r"guard-rail at step \d+ version \d+ \(pause_actors\): ratio/", learner)
    assert "actors resume" in learner
    buffer = _log(rd, "buffer")  # the pause reached the buffer, which passed it on and lifted it
    assert "actors paused" in buffer and buffer.rindex("actors running") > buffer.index("actors paused")
    actor = _log(rd, "actor0")  # ... and the actor's admission followed
    assert actor.rindex("max_staleness 2, running") > actor.index("max_staleness 2, paused")
    recs = [r for r in _learner_records(rd) if "control/action/pause_actors" in r]
    assert recs[-1]["control/action/pause_actors"] >= 1 and recs[-1]["control/paused"] == 0.0
    assert recs[-1]["control/guard/ratio_p99"] + recs[-1]["control/guard/ratio_min"] >= 1
    _books_balance(rd, 20)


def test_rollback_trains_nothing_sampled_by_the_rolled_back_versions(tmp_path, cache_dir, monkeypatch):
    """Batches started at versions 6..7 are skewed; the newest checkpoint before they can be
    trained is step 5's (version 5). The guard fires on the first of them (learner version >= 6):
    back to the checkpoint, under a fresh version, and every group with a token of a version
    after 5 up to the rollback is dropped (a skewed batch started at the republished version 7
    fires again, back to the same checkpoint) -- so none of the skewed groups is in the final
    trained_keys.jsonl."""
    rd = _train(tmp_path, cache_dir, monkeypatch, "6:7:3.0", "run.max_steps=18", *GUARDS,
                "control.guard_action=rollback", "run.ckpt_every=5", "run.ckpt_every_s=0")
    skewed = _skewed_keys(rd)
    assert skewed, "the hook never fired"
    learner = _log(rd, "learner")
    assert "(rollback)" in learner and "rolled back to" in learner
    rollbacks = lines(os.path.join(rd, "rollbacks.jsonl"))
    assert rollbacks and rollbacks[0]["after"] == 5 and all(r["upto"] > r["after"] for r in rollbacks)
    trained, keys = _books_balance(rd, 18)
    assert not skewed & keys, f"trained groups the rolled-back versions sampled: {sorted(skewed & keys)}"
    rolled = lines(os.path.join(rd, "trained_keys.rolled_back.jsonl"))
    assert rolled and not {s["version"] for s in trained} & {s["version"] for s in rolled}
    last = [r for r in _learner_records(rd) if "control/action/rollback" in r][-1]
    assert last["control/action/rollback"] == len(rollbacks) and last["learner/dropped_rolled_back"] >= 1


def test_adaptive_limit_rises_on_a_clean_run_and_falls_on_injected_mismatch(tmp_path, cache_dir, monkeypatch):
    """Clean until version 12, skewed after: the limit climbs from 1 to its maximum, then comes
    down; the learner's own check follows it step by step and the buffer follows it too."""
    rd = _train(tmp_path, cache_dir, monkeypatch, "12:1000:3.0", "run.max_steps=26", "buffer.max_staleness=1",
                "control.adaptive_staleness=true", "control.staleness_max=3", "control.dwell_steps=2",
                "control.ratio_p99_target=1.3")
    recs = [r for r in _learner_records(rd) if "staleness/max" in r]
    limits = [r["control/max_staleness"] for r in recs]
    top = limits.index(max(limits))
    assert max(limits) == 3 and min(limits[top:]) < 3, limits
    assert all(r["learner/step"] < 12 for r in recs[:top + 1]), limits  # raised while still clean
    # what a step trained was fresh under the limit in force when it was fetched
    for prev, r in zip([1.0] + limits, recs):
        assert r["staleness/max"] <= prev, (r["learner/step"], prev, limits)
    assert recs[-1]["control/staleness_changes"] >= 4, limits
    learner = _log(rd, "learner")
    assert "max_staleness 1 -> 2" in learner and "max_staleness 3 -> 2" in learner
    buffer = _log(rd, "buffer")  # the buffer's store followed (its metric is sampled once a second: a log line is not)
    assert buffer.index("max_staleness 2 -> 3") < buffer.index("max_staleness 3 -> 2")
    # the actor's admission followed: up, then down (it looks between its batches, so it may
    # miss a value that lasted less than one of them)
    seen = [int(v) for v in re.findall(r"follows the learner: max_staleness (\d+)", _log(rd, "actor0"))]
    assert seen and max(seen) > 1 and min(seen[seen.index(max(seen)):]) < max(seen), seen
    _books_balance(rd, 26)
