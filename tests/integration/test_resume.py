"""Kill a whole run mid-way, resume it with ``run.py resume``, and check nothing is trained twice
and no version repeats. (A clean stop resumed at its checkpoint, with its optimiser state, is
tests/integration/test_pipeline.py's stage 2.)"""

import json
import os
import subprocess
import sys

from tests.support.runs import alive, lines, models_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "model.pretrain_steps=40", "learner.groups_per_step=4",
        "actor.group_size=4", "actor.groups_per_batch=2", "run.eval_every=0", "monitor.live=off",
        "buffer.max_staleness=1"]


def test_resume_after_a_crash_of_everything_never_repeats_a_version(tmp_path):
    """Every process SIGKILLed mid-run (a power cut, the OOM killer): the resumed run publishes
    the newest checkpoint's weights under a version above every one published before, so no
    version repeats, staleness is never negative, and nothing is trained twice."""
    import signal
    import time

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "run.py", *TINY, f"model.cache_dir={models_dir()}", "run.ckpt_every=2",
           "run.max_steps=100000", "run.max_time_s=300", f"run.run_dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(lines(run_dir / "trained_keys.jsonl")) < 3:
            assert p.poll() is None, "the run ended early"
            time.sleep(0.05)
        pids = json.loads((run_dir / "pids.json").read_text())
        roles = [pid for name, pid in pids.items() if name != "launcher"]
        for pid in roles:  # frozen first: no clean stop, and the launcher restarts nothing
            os.kill(pid, signal.SIGSTOP)
        p.kill()
        p.wait()
        for pid in roles:
            os.kill(pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            p.kill()
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(pid) for pid in pids.values()):
        time.sleep(0.1)
    before = lines(run_dir / "trained_keys.jsonl")
    target = before[-1]["step"] + 3

    out = subprocess.run([sys.executable, "run.py", "resume", str(run_dir), f"run.max_steps={target}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = lines(run_dir / "trained_keys.jsonl")
    rolled = lines(run_dir / "trained_keys.rolled_back.jsonl")
    assert [s["step"] for s in steps] == list(range(1, target + 1))
    versions = [s["version"] for s in steps]
    assert versions == sorted(set(versions)) and not set(versions) & {s["version"] for s in rolled}
    assert max(versions) > max(s["version"] for s in before)
    keys = [tuple(k) for s in steps for k in s["keys"]]
    assert len(keys) == len(set(keys))
    with open(run_dir / "metrics.jsonl") as f:
        learner = [r for r in map(json.loads, f) if r["role"] == "learner" and "staleness/hist" in r]
    assert learner and all(r["staleness/mean"] >= 0 for r in learner)
