"""Precision ablation: the default job with FP32 islands on, then with everything in the body dtype.

    python bench/precision_ablation.py [--steps 300] [section.key=value ...]

Both runs use the same seed, base model and actor (FP32 engine on CPU); only the learner's
precision policy changes:

* ``islands``: body BF16 (autocast), attention softmax FP32, LM head + log-softmax FP32
* ``body``:    body BF16, attention softmax BF16, LM head + log-softmax BF16

Printed side by side per run: the ratio p50 / p99 / max and the mismatch KL (k3), aggregated over
every learner step (median of per-step p50, mean of per-step p99, max of per-step max, mean k3),
plus the contract-check mismatch at step 0 (same weights on both sides: pure numerics).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core import config as C  # noqa: E402
from run import train  # noqa: E402

VARIANTS = {
    "islands": ["learner.fp32_attn_softmax=true", "learner.fp32_head=true"],
    "body": ["learner.fp32_attn_softmax=false", "learner.fp32_head=false",
             # the contract check would (rightly) refuse the degraded numerics; the ablation
             # wants to measure them, so widen its bound for this run only
             "learner.contract_max_abs_logp_diff=10", "learner.contract_max_kl_k3=10"],
}


def summarise(run_dir: str, contract: dict) -> dict:
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in recs if r.get("role") == "learner" and r.get("ratio/p99") is not None]

    def col(key):
        return [r[key] for r in steps if r.get(key) is not None]

    return {
        "steps": len(steps),
        "ratio_p50": statistics.median(col("ratio/p50")),
        "ratio_p99": statistics.fmean(col("ratio/p99")),
        "ratio_p999": statistics.fmean(col("ratio/p999")),
        "ratio_max": max(col("ratio/max")),
        # staleness 0 isolates engine/learner numerics from policy lag (DESIGN §6 split)
        "ratio_p99_stale0": statistics.fmean(col("ratio/p99_by_staleness/0")),
        "kl_k3": statistics.fmean(col("mismatch/kl_k3")),
        "abs_logp_diff_p99": statistics.fmean(col("mismatch/abs_logp_diff_p99")),
        "final_eval": next((r["eval/reward"] for r in reversed(recs) if r.get("eval/reward") is not None), None),
        "contract_at_v0": contract,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = {}
    base = tempfile.mkdtemp(prefix="driftrl-ablation-")
    for name, extra in VARIANTS.items():
        cfg = C.load(None, [f"run.max_steps={args.steps}", "run.max_time_s=0", "monitor.live=off",
                            "monitor.refresh_s=30", *args.overrides, *extra])
        res = train(cfg, os.path.join(base, name))
        if res.interrupted:
            sys.exit(130)
        out[name] = summarise(res.run_dir, res.contract)
    keys = ["ratio_p50", "ratio_p99", "ratio_p999", "ratio_max", "ratio_p99_stale0", "kl_k3", "abs_logp_diff_p99", "final_eval"]
    print(f"\n{'metric':<20}{'FP32 islands':>16}{'all body dtype':>16}")
    for k in keys:
        a, b = out["islands"][k], out["body"][k]
        print(f"{k:<20}{a:>16.6g}{b:>16.6g}")
    print(f"contract check at v0: islands {out['islands']['contract_at_v0']}")
    print(f"                      body    {out['body']['contract_at_v0']}")
    print(json.dumps({"bench": "precision_ablation", "steps": args.steps,
                      "p99_ratio_body_over_islands": out["body"]["ratio_p99"] / out["islands"]["ratio_p99"],
                      "kl_ratio_body_over_islands": out["body"]["kl_k3"] / max(out["islands"]["kl_k3"], 1e-30),
                      **{f"{v}_{k}": out[v][k] for v in out for k in keys}}))


if __name__ == "__main__":
    main()
