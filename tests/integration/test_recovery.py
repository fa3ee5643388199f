"""A crashed learner and a killed launcher, on real processes driven by the real launcher: the
learner comes back from its checkpoint losing and repeating nothing; no role outlives the
launcher."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from core import config as C
import run
from tests.support.runs import ROOT, TINY_RUN, alive, lines


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


def test_killed_learner_comes_back_from_its_checkpoint(tmp_path, cache_dir):
    """SIGKILL the learner mid-run: the launcher restarts it, it continues from its newest
    checkpoint under a fresh version, the run completes, the buffer's books balance, and no key
    is trained twice nor any version published twice."""
    cfg = C.load(None, TINY_RUN + [f"model.cache_dir={cache_dir}", "buffer.max_staleness=1", "run.ckpt_every=3",
                                   "run.max_steps=14", "run.max_time_s=150"])
    killed = []

    def killer(run_dir, procs):
        def work():
            path = os.path.join(run_dir, "trained_keys.jsonl")
            deadline = time.time() + 60
            while time.time() < deadline and len(lines(path)) < 5:
                time.sleep(0.05)
            killed.append(len(lines(path)))
            os.kill(next(r for r in procs if r.name == "learner").pid, signal.SIGKILL)
        threading.Thread(target=work, daemon=True).start()

    result = run.train(cfg, str(tmp_path / "run"), on_ready=killer)
    assert killed and not result.interrupted and result.returncodes["learner"] == 0
    rd = result.run_dir
    steps = lines(os.path.join(rd, "trained_keys.jsonl"))
    rolled = lines(os.path.join(rd, "trained_keys.rolled_back.jsonl"))
    assert [s["step"] for s in steps] == list(range(1, 15))
    versions = [s["version"] for s in steps]
    assert versions == sorted(set(versions))  # monotonic, no repeat
    assert not set(versions) & {s["version"] for s in rolled}  # a rolled-back version is never reused
    keys = [tuple(k) for s in steps for k in s["keys"]]
    assert len(keys) == len(set(keys))
    with open(os.path.join(rd, "logs", "learner.log")) as f:
        log = f.read()
    assert log.count("learner ready at version") == 2 and "resumed from" in log
    recs = lines(os.path.join(rd, "metrics.jsonl"))
    assert any(r.get("run/restarts/learner") == 1.0 for r in recs)
    buf = [r for r in recs if r["role"] == "buffer" and "buffer/invariant_ok" in r]
    assert buf and buf[-1]["buffer/invariant_ok"] == 1.0
    learner = [r for r in recs if r["role"] == "learner" and "staleness/max" in r]
    assert learner and max(r["staleness/max"] for r in learner) <= 1
    with open(os.path.join(rd, "pids.json")) as f:
        assert not any(alive(pid) for name, pid in json.load(f).items() if name != "launcher")


def test_sigkilled_launcher_leaves_no_role_behind(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "run.py", *TINY_RUN, f"model.cache_dir={cache_dir}", "run.max_steps=100000",
           "run.max_time_s=300", f"run.run_dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(lines(run_dir / "trained_keys.jsonl")) < 2:
            assert p.poll() is None, "the run ended early"
            time.sleep(0.2)
        roles = {n: pid for n, pid in json.loads((run_dir / "pids.json").read_text()).items() if n != "launcher"}
        p.kill()
        p.wait()
        deadline = time.time() + 30
        while time.time() < deadline and any(alive(pid) for pid in roles.values()):
            time.sleep(0.2)
        left = {n: pid for n, pid in roles.items() if alive(pid)}
    finally:
        if p.poll() is None:
            p.kill()
    for pid in left.values():
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running 30 s after the launcher died: {left}"
