"""The `driftrl` command `pip install` puts beside the interpreter runs the same subcommands
as `python run.py`, from any directory (not only a checkout)."""

import json
import os
import subprocess
import sys

from tests.support.tiny import tiny_model_dir

DRIFTRL = os.path.join(os.path.dirname(sys.executable), "driftrl")


def test_the_installed_command_exists_and_names_itself_in_its_help(tmp_path):
    assert os.access(DRIFTRL, os.X_OK), f"{DRIFTRL} missing: pip install -e . installs it"
    out = subprocess.run([DRIFTRL, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: driftrl") and "pipeline" in out.stdout


def test_driftrl_eval_from_outside_the_checkout_reports_json(tmp_path):
    out = subprocess.run([DRIFTRL, "eval", tiny_model_dir(), "--k", "2", "run.eval_prompts=8",
                          "actor.max_new_tokens=6"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])["tasks"]["arith"]
    assert r["k"] == 2 and r["prompts"] == 8 and 0.0 <= r["pass@1"] <= r["pass@k"] <= 1.0
    bad = subprocess.run([DRIFTRL, "train", "learner.lr=-1"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "learner.lr" in bad.stderr  # `train` is a subcommand too, same errors
    assert not os.listdir(tmp_path)  # nothing was written where it was run
