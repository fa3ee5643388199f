"""Whole runs (``python run.py``, real processes) on the external tasks with a text checkpoint:
a reasoning-gym mix and a JSONL math file made here, scored by the real scorers in the reward
pool; in the math run a planted checker hangs on the first answer, is killed within its
timeout and counted, and the run still reaches its step budget."""

import json
import subprocess
import sys

import pytest

from core import config as C
import jobs
from tests.support import patched_actor
from tests.support.runs import ROOT, TINY_RUN, alive, lines
from tests.support.scorers import HANG_MARKER_ENV
from tests.support.textmodel import text_model_dir

pytestmark = pytest.mark.slow
STEPS = 3
RUN = [*TINY_RUN, f"run.max_steps={STEPS}", "run.max_time_s=120", "run.eval_prompts=8", "actor.max_new_tokens=16"]


def _run(tmp_path, overrides, monkeypatch=None):
    """``python run.py`` as a user runs it; with ``monkeypatch`` (a test's patched actors), the
    same run through ``jobs.train`` in this process, whose launcher the test has patched."""
    run_dir = tmp_path / "run"
    args = [f"model.path={text_model_dir()}", f"run.run_dir={run_dir}", *RUN, *overrides]
    if monkeypatch is None:
        cmd = [sys.executable, "run.py", *args]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    else:
        result = jobs.train(C.load(None, args), str(run_dir))
        assert not result.interrupted and result.returncodes["learner"] == 0
    recs = lines(run_dir / "metrics.jsonl")
    learner = [r for r in recs if r["role"] == "learner" and "learner/step" in r]
    assert learner and max(r["learner/step"] for r in learner) == STEPS
    actor = [r for r in recs if r["role"] == "actor" and "reward/checks" in r]
    assert actor and all(0.0 <= r["reward/mean"] <= 1.0 for r in actor)
    assert actor[-1]["reward/checks"] > 0  # completions ended with EOS and the real scorer checked them
    return actor[-1], run_dir


def test_reasoning_gym_run(tmp_path):
    last, _ = _run(tmp_path, ["task.name=gym", 'task.datasets=["basic_arithmetic", "chain_sum"]',
                                       "task.reward_workers=1"])
    assert last["reward/timeouts"] == 0 and last["reward/errors"] == 0


def test_math_file_run_survives_a_hanging_checker(tmp_path, monkeypatch):
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "level": 1 + a % 3} for a in range(12) for b in (3, 7)]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    marker = tmp_path / "hung"
    timeout = 2.0
    monkeypatch.setenv(HANG_MARKER_ENV, str(marker))
    patched_actor.use(monkeypatch, "--scorer", "tests.support.scorers:hang_once_then_math")
    last, run_dir = _run(
        tmp_path, ["task.name=math", f"task.path={path}", "task.reward_workers=2", f"task.reward_timeout_s={timeout}"],
        monkeypatch)
    assert not alive(int(marker.read_text()))  # the planted checker hung on one answer, was killed...
    assert last["reward/timeouts"] >= 1 and last["reward/errors"] == 0  # ...and counted
    log = (run_dir / "logs" / "actor0.log").read_text()
    assert f"reward check timed out after {timeout:.1f} s" in log
