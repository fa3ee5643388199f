"""bench/precision.py end to end in a tiny configuration, so the bench cannot rot: it builds its
checkpoint, samples one fixed set of completions with the engine in BF16, scores them under the
five learner precision policies and ends with the JSON line bench/README.md quotes. No numeric
targets (numerics differ between AVX2 and AMX CPUs): only properties any correct run has."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICIES = ("fp32", "islands", "head_only", "softmax_only", "bf16")
KEYS = ("ratio_mean", "ratio_p50", "ratio_p99", "ratio_p999", "ratio_max", "ratio_min", "kl_k3",
        "abs_logp_diff_mean", "abs_logp_diff_p99", "vs_fp32_abs_logp_p99", "ms_per_step")
TINY = ["--vocab", "2048", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--intermediate", "128", "--prompts", "3", "--group", "2", "--response-len", "24",
        "--time-reps", "1"]


def run_bench(tmp_path, *extra):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "precision.py"), *TINY, *extra],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_precision_bench_scores_one_fixed_set_under_every_policy(tmp_path):
    out = run_bench(tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bench"] == "precision" and tuple(res["policies"]) == POLICIES
    # no completion stopped early: every one is exactly --response-len tokens
    assert res["tokens_scored"] == 3 * 2 * 24 and res["actor_dtype"] == "bfloat16"
    for name, p in res["policies"].items():
        for key in KEYS:
            assert p[key] is not None and math.isfinite(p[key]), (name, key)
        assert p["ratio_min"] <= 1.0 <= p["ratio_max"], name
        assert p["ms_per_step"] > 0 and p["kl_k3"] >= 0, name
    # the reference against itself is exact; every BF16-body policy really computes differently
    assert res["policies"]["fp32"]["vs_fp32_abs_logp_p99"] == 0.0
    for name in POLICIES[1:]:
        assert res["policies"][name]["vs_fp32_abs_logp_p99"] > 0.0, name
    assert 0.0 < res["mean_entropy"] < math.log(2048)
    assert 0.0 < res["attn_logit_abs_mean"] <= res["attn_logit_abs_max"]
    assert res["model"]["vocab_size"] == 2048 and res["model"]["model_type"] == "llama"
    assert set(res["cpu_flags"]) >= {"avx2", "avx512_bf16", "amx_bf16"}
    table = out.stdout.split("policy", 1)[1]
    assert all(name in table for name in POLICIES)


def test_precision_bench_names_a_bad_flag(tmp_path):
    out = run_bench(tmp_path, "--group", "1")
    assert out.returncode == 2 and "--group must be >= 2, got 1" in out.stderr
