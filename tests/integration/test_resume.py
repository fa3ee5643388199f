"""Stop a run mid-way, resume it from its run directory, and check nothing is trained twice."""

import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from core import config as C
import run
from learner import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "model.pretrain_steps=40", "learner.groups_per_step=4",
        "actor.group_size=4", "actor.groups_per_batch=2", "run.eval_every=0", "monitor.live=off",
        "buffer.max_staleness=1"]


def _trained(run_dir):
    with open(os.path.join(run_dir, "trained_keys.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resume_continues_at_the_same_version_without_retraining(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = C.load(None, TINY + [f"model.cache_dir={tmp_path / 'models'}", "run.max_steps=4"])
    first = run.train(cfg, run_dir)
    assert not first.interrupted
    ck4 = checkpoint.latest(os.path.join(run_dir, "checkpoints"))
    assert ck4.endswith("step_000004")
    saved_optim = load_file(os.path.join(ck4, "optim.safetensors"))

    out = subprocess.run([sys.executable, "run.py", "resume", run_dir, "run.max_steps=8"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    steps = _trained(run_dir)
    assert [s["version"] for s in steps] == list(range(1, 9))  # versions continue 5..8 after resume
    keys = [tuple(k) for s in steps for k in s["keys"]]
    assert len(keys) == len(set(keys)) == 8 * 4  # no group trained twice
    with open(os.path.join(run_dir, "logs", "learner.log")) as f:
        assert "resumed from" in f.read()

    # the resumed learner continued the saved optimiser state instead of starting afresh
    ck8 = checkpoint.latest(os.path.join(run_dir, "checkpoints"))
    assert ck8.endswith("step_000008")
    resumed_optim = load_file(os.path.join(ck8, "optim.safetensors"))
    step_keys = [k for k in saved_optim if k.endswith(".step")]
    assert step_keys and all(float(saved_optim[k]) == 4 for k in step_keys)
    assert all(float(resumed_optim[k]) == 8 for k in step_keys)
