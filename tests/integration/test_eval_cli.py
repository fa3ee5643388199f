"""``run.py eval``: a real checkpoint evaluated by the real engine and task; the JSON report is
the last stdout line, with pass@1 <= pass@k and a split per tier and difficulty."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from actor.evaluate import pass_at
from jobs import resolve_checkpoint
from tests.support.runs import ROOT
from tests.support.tiny import tiny_model_dir


def test_pass_at_counts_prompts_and_samples():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=float)
    assert pass_at(correct) == {"pass@1": 5 / 12, "pass@k": 2 / 3}


def test_resolve_checkpoint_kinds(tmp_path):
    model = tiny_model_dir()
    assert resolve_checkpoint(model) == (os.path.abspath(model), None)
    step = tmp_path / "run" / "checkpoints" / "step-5"
    shutil.copytree(model, step / "model")
    assert resolve_checkpoint(str(step))[0] == str(step / "model")
    shutil.copytree(model, tmp_path / "run" / "final_model")
    (tmp_path / "run" / "config.json").write_text("{}")
    assert resolve_checkpoint(str(tmp_path / "run")) == (str(tmp_path / "run" / "final_model"),
                                                         str(tmp_path / "run" / "config.json"))
    with pytest.raises(FileNotFoundError, match="not a run, checkpoint or model"):
        resolve_checkpoint(str(tmp_path))


def test_eval_command_reports_pass_at_k_as_the_last_line():
    out = subprocess.run([sys.executable, "run.py", "eval", tiny_model_dir(), "arith", "--k", "3",
                          "run.eval_prompts=24", "actor.max_new_tokens=6"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    r = report["tasks"]["arith"]
    assert r["k"] == 3 and r["prompts"] == 24
    assert 0.0 <= r["pass@1"] <= r["pass@k"] <= 1.0
    assert 0 < r["mean_length"] <= 6
    assert sum(t["prompts"] for t in r["by_tier"].values()) == 24
    assert "eval arith: 24/24" in out.stderr  # progress is shown (log lines off a terminal)


def test_eval_command_rejects_an_unknown_task():
    out = subprocess.run([sys.executable, "run.py", "eval", tiny_model_dir(), "nosuchtask"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nosuchtask" in out.stderr
