"""``run.py sweep``: a real two-setting sweep of tiny trainings, cut by Ctrl-C during its second
training and finished with ``--resume``; the JSON (the last stdout line) agrees with every run's
own metrics.jsonl."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.runs import ROOT, TINY_RUN, lines, models_dir

pytestmark = pytest.mark.slow
FAST = [t for t in TINY_RUN if not t.startswith("run.eval_every=")] + [
    "run.eval_every=4", "run.eval_prompts=16", "run.max_steps=5", "run.max_time_s=0"]
PER_STEP = 4 * 4  # learner.groups_per_step x actor.group_size of TINY_RUN


def _sweep(args, tmp_path, interrupt_when=None):
    cmd = [sys.executable, "run.py", "sweep", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if interrupt_when is not None:
        deadline = time.time() + 90
        while not os.path.exists(interrupt_when) and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def _check_against_metrics(run: dict):
    recs = lines(os.path.join(run["run_dir"], "metrics.jsonl"))
    learner = [r for r in recs if r["role"] == "learner" and "learner/step" in r]
    steady = learner[1:]  # the first step waits for the actors' start-up
    busy = sum(r["learner/wait_s"] + r["learner/step_s"] for r in steady)
    assert run["steps"] == 5 == max(r["learner/step"] for r in learner)
    assert run["samples"] == sum(learner[-1]["staleness/hist"])  # the learner's own count
    assert run["samples_per_s"] == pytest.approx((len(learner) - 1) * PER_STEP / busy, rel=1e-9)
    assert run["idle_frac"] == pytest.approx(sum(r["learner/wait_s"] for r in steady) / busy, rel=1e-9)
    assert run["steady_s"] <= learner[-1]["time/elapsed_s"] - learner[0]["time/elapsed_s"] + 1e-3
    lags = {k.rsplit("/", 1)[1] for r in learner for k, v in r.items()
            if k.startswith("ratio/p99_by_staleness/") and v is not None}
    assert set(run["ratio_p99_by_lag"]) == lags and "0" in lags
    assert max(map(int, lags)) <= run["setting"]["buffer.max_staleness"]
    for s, v in run["ratio_p99_by_lag"].items():
        vals = [r[f"ratio/p99_by_staleness/{s}"] for r in learner if r.get(f"ratio/p99_by_staleness/{s}") is not None]
        assert v == pytest.approx(sum(vals) / len(vals))
    final = [r for r in recs if r.get("eval/final")]
    assert len(final) == 1 and run["reward_final"] == final[0]["eval/reward"]
    assert run["reward_start"] == next(r["eval/reward"] for r in recs if "eval/reward" in r and not r.get("eval/final"))
    drops = max([0.0] + [r["buffer/dropped_stale"] for r in recs if "buffer/dropped_stale" in r])
    assert run["drops"]["total"] == drops + max(r["learner/dropped_stale"] for r in learner)


def test_sweep_interrupted_then_resumed_reports_every_run(tmp_path):
    out = tmp_path / "sweep"
    args = ["buffer.max_staleness=0,1", "--seeds", "1", *FAST, f"model.cache_dir={models_dir()}",
            "--out", str(out)]
    second = out / "01-max_staleness=1-seed0"
    rc, stdout, stderr = _sweep(args, tmp_path, interrupt_when=second / "pids.json")
    assert rc == 130, stderr[-3000:]
    rep = json.loads(stdout.strip().splitlines()[-1])
    assert rep["interrupted"] and rep["finished"] == 1 and rep["planned"] == 2
    assert f"python run.py sweep --resume {out}" in stdout

    rc, stdout, stderr = _sweep(["--resume", str(out)], tmp_path)
    assert rc == 0, stderr[-3000:]
    rep = json.loads(stdout.strip().splitlines()[-1])
    assert rep == json.loads((out / "sweep.json").read_text())
    assert not rep["interrupted"] and rep["finished"] == 2 and not rep["failed"]
    assert (out / "01-max_staleness=1-seed0.interrupted").is_dir()  # the cut training, kept aside
    assert "finished before" in stderr  # the first training was not run again
    assert [s["label"] for s in rep["settings"]] == ["buffer.max_staleness=0", "buffer.max_staleness=1"]
    assert all(s["runs"] == 1 and s["reward_final"]["std"] is None for s in rep["settings"])
    assert "spread unknown" in stdout and (out / "sweep.png").stat().st_size > 0
    for run in rep["runs"]:
        _check_against_metrics(run)
    assert rep["runs"][0]["ratio_p99_by_lag"].keys() == {"0"}  # max_staleness=0 trains on lag 0 only
