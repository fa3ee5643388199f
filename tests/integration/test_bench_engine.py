"""bench/engine.py end to end at the tiny preset, so that bench cannot rot: the checkpoint is
written by transformers and loaded by both sides, each side runs in its own process and
generates exactly the requested tokens (the bench checks it), and the last line carries the
figures bench/README.md quotes. No timing assertions: only that the figures exist and are sane."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["fixed", "rollout"])
def test_engine_bench_runs_both_sides_and_ends_with_its_json_line(tmp_path, workload):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "engine.py"), "--preset", "tiny",
                          "--new-tokens", "8", "--batch", "3", "--threads", "1", "--workload", workload,
                          "--waves", "2"],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bench"] == "engine" and res["new_tokens"] == 8 and res["batch"] == 3
    for key in ("ratio", "ratio_cpu", "engine_tokens_per_s", "hf_tokens_per_s"):
        assert math.isfinite(res[key]) and res[key] > 0, key
    for side in ("engine", "hf"):
        assert 50 < res[f"{side}_peak_rss_mb"] < 4096  # an interpreter with torch, a tiny model
        (run,) = res["runs"][side]
        if workload == "fixed":
            assert run["tokens"] == 3 * 8
        else:  # 6 prompts that may stop early: at least one token each, at most the cap
            assert 6 <= run["tokens"] <= 6 * 8 and res["prompts"] == 6
    assert 50_000 < res["model_params"] < 500_000
    assert "ratio (engine / transformers tokens/s)" in out.stdout
