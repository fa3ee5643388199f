"""A killed launcher, on real processes driven by the real launcher: no role outlives it. (A
killed learner, buffer or actor coming back losing and repeating nothing: test_selfheal.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.runs import ROOT, TINY_RUN, alive, lines, models_dir


@pytest.fixture(scope="module")
def cache_dir():
    return models_dir()  # the tiny model, built once for all the whole-run tests


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_sigkilled_launcher_leaves_no_role_behind(tmp_path, cache_dir, launcher):
    """Nor its weights' directory in /dev/shm (which each role's exit path removes)."""
    if launcher == "ray":
        pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "run.py", *TINY_RUN, f"model.cache_dir={cache_dir}", "run.max_steps=100000",
           "run.max_time_s=300", f"run.run_dir={run_dir}", f"run.launcher={launcher}"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(lines(run_dir / "trained_keys.jsonl")) < 2:
            assert p.poll() is None, "the run ended early"
            time.sleep(0.2)
        roles = {n: pid for n, pid in json.loads((run_dir / "pids.json").read_text()).items() if n != "launcher"}
        shm = (run_dir / "weights.shm").read_text().strip()  # the weights' directory in /dev/shm
        assert os.path.isdir(shm)
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
    assert shm and not os.path.exists(shm), f"{shm} outlived the run"
