"""Actor, buffer and learner as real processes on loopback, driven by the real launcher."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from core import config as C
import jobs
from tests.support.runs import alive, models_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "model.pretrain_steps=40", "learner.groups_per_step=4",
        "actor.group_size=4", "actor.groups_per_batch=2", "run.eval_every=2", "run.eval_prompts=32",
        "monitor.live=off"]


@pytest.fixture(scope="session")
def cache_dir():
    return models_dir()  # the tiny model, built once for all the whole-run tests


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]




# the second run also sends its weights as deltas (weightsync.delta: filesystem, BF16 actors, an RL learning rate)
DELTAS = ['weightsync.transport="filesystem"', "actor.dtype=bfloat16", "learner.lr=1e-6", "weightsync.full_every=4"]


@pytest.mark.parametrize("staleness,strategy,extra", [(0, "drop", []), (2, "wait", DELTAS)])
def test_run_end_to_end(tmp_path, cache_dir, staleness, strategy, extra):
    cfg = C.load(None, TINY + [f"model.cache_dir={cache_dir}", f"buffer.max_staleness={staleness}",
                               f'buffer.stale_strategy="{strategy}"', "run.max_steps=8", "run.max_time_s=120", *extra])
    result = jobs.train(cfg, str(tmp_path / "run"))
    assert not result.interrupted
    recs = _records(result.run_dir)
    learner = [r for r in recs if r["role"] == "learner"]
    versions = [r["learner/version"] for r in learner]
    assert versions == sorted(versions) and versions[-1] == 8
    hist = learner[-1]["staleness/hist"]
    assert sum(hist) == 8 * 4 * 4  # every trained sample counted once
    assert len(hist) - 1 <= staleness  # nothing above the bound
    assert max(r["staleness/max"] for r in learner) <= staleness
    for key in ("ratio/p50", "ratio/p99", "ratio/max", "mismatch/kl_k3", "learner/loss"):
        assert all(key in r for r in learner)
    # each role's memory; the learner writes its weight versions without mapping them (the shm transport's files
    # are /dev/shm's): none of its resident memory is theirs
    mem = [r for r in learner if "learner/step_s" in r]
    assert mem and all(r["learner/peak_rss_mb"] >= r["learner/rss_mb"] > r["learner/shm_mb"] >= 0 for r in mem)
    version_mb = max(r["weightsync/bytes"] for r in learner if "weightsync/bytes" in r) / 2**20
    assert version_mb > 0 and all(r["learner/shm_mb"] < version_mb for r in mem)
    held = jobs.learner_memory(result.run_dir)  # what run.py prints at the end: the peak against the state
    assert held["peak_rss_mb"] == max(r["learner/peak_rss_mb"] for r in mem) > held["state_mb"] > 0
    assert all(r["ratio/p50"] is None or 0.5 < r["ratio/p50"] < 2 for r in learner)
    actor = [r for r in recs if r["role"] == "actor" and "reward/mean" in r]
    assert actor and all(0.0 <= r["reward/mean"] <= 1.0 for r in actor)
    assert all(r["actor/peak_rss_mb"] >= r["actor/rss_mb"] > 0 for r in actor)
    assert all(r["reward/by_tier/default"] == r["reward/mean"] for r in actor)  # arith has one tier
    # actor.skip_uniform_groups (default): this barely trained model gives many groups equal rewards;
    # the actor leaves them out (counted) and the learner reports each step's zero-advantage groups
    assert max(r["actor/uniform_groups"] for r in actor) > 0 and all("learner/uniform_groups" in r for r in learner)
    # the discard funnel's books close: every generated group was trained, lost for a counted reason, or is held
    books = jobs.funnel_of(result.run_dir)
    assert books.total("generated") > books.total("trained") == 8 * 4 and books.lost()["no_signal"] > 0
    assert books.balance() == 0, books.line()
    if strategy == "wait":  # the learner waited for the groups in generation: none went stale
        assert not [r for r in books.lost() if r.startswith("stale")], books.line()
    assert any("eval/reward" in r for r in recs)
    if extra:  # versions 0, 4, 8 full, the others deltas, every actor up to date at the end
        sync = [r for r in learner if "weightsync/full_versions" in r][-1]
        assert sync["weightsync/full_versions"] == 3 and sync["weightsync/sent_frac"] < 0.8, sync
        assert max(r["actor/version"] for r in recs if r["role"] == "actor" and "actor/version" in r) == 8
    if staleness:
        assert any(r["staleness/max"] >= 1 for r in learner), "async run never ran ahead"
    assert os.path.exists(os.path.join(result.run_dir, "final_model", "model.safetensors"))
    for name in ("buffer", "learner", "actor0"):
        assert os.path.getsize(os.path.join(result.run_dir, "logs", f"{name}.log")) > 0
    with open(os.path.join(result.run_dir, "pids.json")) as f:
        pids = json.load(f)
    assert not any(alive(pid) for name, pid in pids.items() if name != "launcher")
    shared = [p for d, _, names in os.walk(result.run_dir) for p in [os.path.join(d, n) for n in names]
              if os.path.isfile(p) and os.stat(p).st_mode & 0o077]
    assert not shared, shared  # logs, metrics, pids, tail, audit, checkpoints: the user's alone


def test_ctrl_c_leaves_nothing_behind(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "run.py", *TINY, f"model.cache_dir={cache_dir}", "run.max_steps=100000",
           "run.max_time_s=300", f"run.run_dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (run_dir / "metrics.jsonl").exists() and any(
                    json.loads(line).get("role") == "learner" for line in open(run_dir / "metrics.jsonl")):
                break
            assert p.poll() is None, p.stdout.read().decode()
            time.sleep(0.2)
        else:
            pytest.fail("the learner never reported a step")
        pids = json.loads((run_dir / "pids.json").read_text())
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, out.decode()[-2000:]
    assert b"resume" in out
    assert not any(alive(pid) for pid in pids.values())


def test_run_dir_is_private(tmp_path, cache_dir):
    from core import launchers

    cfg = C.load(None, TINY + [f"model.cache_dir={cache_dir}", "model.path=/nonexistent"])
    _, run_dir = launchers.prepare(cfg, str(tmp_path / "run"))
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(run_dir, "config.json")).st_mode & 0o777 == 0o600
