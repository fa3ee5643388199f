"""A real run with ``learner.context_parallel=2`` (two learner ranks over Gloo, the launcher's learner
role being rank 0), under the local and the Ray launcher: it passes the contract check, trains, checkpoints; SIGKILL of the second rank
mid-run restarts the whole learner from its checkpoint, and key by key every group the buffer
acknowledged is trained exactly once, still resident, or dropped and counted (tests/support/books.py)."""

import os
import re
import signal
import threading

import pytest

import jobs
from core import config as C
from learner import audit
from tests.support import books
from tests.support.runs import TINY_RUN, alive, lines, models_dir, read_json, wait_until

STEPS = 20
KILL_AFTER = 6  # trained steps
RESUMED = re.compile(r"resumed from (\S+) at step (\d+) version (\d+) \(checkpoint version (\d+)\)")


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _learner_pid(run_dir: str) -> int | None:
    return (read_json(os.path.join(run_dir, "pids.json")) or {}).get("learner")  # rewritten on every restart


def _kill_rank1(run_dir: str, killed: dict) -> None:
    trained = os.path.join(run_dir, "trained_keys.jsonl")
    if not wait_until(lambda: len(lines(trained)) >= KILL_AFTER, 120):
        return
    learner = _learner_pid(run_dir)
    ranks = _children(learner)
    if len(ranks) != 1:
        killed["ranks"] = ranks
        return
    os.kill(ranks[0], signal.SIGKILL)
    killed.update(rank=ranks[0], learner=learner, step=len(lines(trained)))
    back = wait_until(lambda: _learner_pid(run_dir) not in (None, learner) and len(lines(trained)) > killed["step"] + 1,
                      120)
    new = _learner_pid(run_dir)
    killed["new_ranks"] = _children(new) if back and alive(new) else []


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_a_two_rank_learner_trains_and_restarts_whole_when_a_rank_dies(tmp_path, launcher):
    if launcher == "ray":
        pytest.importorskip("ray")
    cfg = C.load(None, TINY_RUN + [f"model.cache_dir={models_dir()}", "learner.context_parallel=2",
                                   f"run.launcher={launcher}",
                                   "buffer.max_staleness=1", "run.ckpt_every=3", f"run.max_steps={STEPS}",
                                   "run.max_time_s=300", "run.restart_backoff_s=0.2"])
    killed: dict = {}

    def on_ready(run_dir, procs):
        threading.Thread(target=_kill_rank1, args=(run_dir, killed), daemon=True).start()

    result = jobs.train(cfg, str(tmp_path / "run"), on_ready=on_ready)
    rd = result.run_dir
    assert "rank" in killed, f"no single rank-1 process to kill: {killed}"
    assert len(killed.get("new_ranks", [])) == 1, killed  # the restarted learner started its own rank 1
    assert not result.interrupted and result.returncodes["learner"] == 0

    recs = lines(os.path.join(rd, "metrics.jsonl"))
    assert [r["run/restarts/learner"] for r in recs if "run/restarts/learner" in r] == [1.0]
    with open(os.path.join(rd, "logs", "learner.log")) as f:
        log = f.read()
    assert "the learner restarts whole" in log or "a context-parallel rank died during a step" in log
    resumed = RESUMED.findall(log)
    assert len(resumed) == 1 and int(resumed[0][1]) >= 3, resumed  # from a checkpoint, not the start
    steps = audit.read(os.path.join(rd, audit.TRAINED))
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    books.check(rd, STEPS)
    assert not alive(killed["new_ranks"][0])  # the restarted rank 1 ended with the run
