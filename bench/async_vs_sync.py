"""Bench: asynchronous (max_staleness 1, 2) vs synchronous (max_staleness 0) driftrl, same machine.

Each configuration runs the whole system (buffer + learner + actor processes, real sockets and
shared-memory weight sync) for the same wall-time budget of training (``--seconds``), with the
same seed. ``max_staleness = 0`` is the synchronous baseline: an actor may not start a batch
before the learner has published the version that will consume it, so decode and training
alternate; with ``max_staleness >= 1`` the actor decodes the next step's groups
while the learner trains.

Per run: learner samples/s (completions trained on / training wall time), learner idle fraction
(time waiting for data / learner wall), actor idle fraction (admission + buffer back-pressure
wait / wall), where the time went (generation, learner compute, weight sync publish/apply,
waits), mean staleness, and the held-out reward of the final weights (``actor.evaluate.final_eval``)
after that equal wall time. Target (issue): best async >= 1.5x sync samples/s, learner idle < 15%.

    python bench/async_vs_sync.py [--seconds 50] [--repeats 2] [--staleness 0,1,2] [-o actor.groups_per_batch=16]

Levels run round-robin ``--repeats`` times (other work on a shared machine then slows every level
alike); each level reports its median-throughput repeat, with every repeat's samples/s alongside.

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    CpuMeter, final_reward, format_table, json_safe, load_avg, ratio, resolved_config, run_driftrl, summarize_run,
)


def run_one(staleness: int, seconds: float, extra: list[str], eval_prompts: int, run_dir: str) -> dict:
    overrides = [f"buffer.max_staleness={staleness}", f"run.max_time_s={seconds}", "run.max_steps=0",
                 "run.eval_every=0", f"run.eval_prompts={eval_prompts}", *extra]
    cfg = resolved_config(overrides)
    load_before = load_avg()[0]
    with CpuMeter() as cpu:
        result, records, _ = run_driftrl(cfg, run_dir)
    s = summarize_run(records, cfg.learner.groups_per_step, cfg.actor.group_size)
    s.update(max_staleness=staleness, final_reward=final_reward(records), total_wall_s=result.wall_s,
             load1_before=load_before, foreign_cores=cpu.result["foreign_cores"], run_dir=run_dir)
    return s


def median_run(reps: list[dict]) -> dict:
    """The repeat with the median samples/s (lower median for an even count), plus the spread."""
    ordered = sorted(reps, key=lambda r: r["samples_per_s"])
    pick = dict(ordered[(len(ordered) - 1) // 2])
    pick["samples_per_s_all"] = [r["samples_per_s"] for r in reps]
    pick["final_reward_all"] = [r["final_reward"] for r in reps]
    return pick


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=50.0, help="training wall-time budget of each run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per level, interleaved; the median is reported")
    ap.add_argument("--staleness", default="0,1,2", help="comma-separated max_staleness values; 0 = sync")
    ap.add_argument("-o", "--override", action="append", default=[],
                    help="extra section.key=value applied to every run (repeatable)")
    ap.add_argument("--eval-prompts", type=int, default=512)
    ap.add_argument("--out", default="", help="parent directory of the run dirs (default: a temp dir)")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.staleness.split(",")]
    if 0 not in levels or len(levels) < 2:
        ap.error("--staleness must include 0 (the sync baseline) and at least one async level")
    out_dir = args.out or tempfile.mkdtemp(prefix="bench-async-")
    print(f"load average before: {load_avg()[0]:.2f}; {args.repeats} x {len(levels)} runs of {args.seconds:.0f}s "
          f"in {out_dir}; overrides {args.override or 'none'}", flush=True)

    # round-robin (0,1,2,0,1,2,...): load that drifts during the bench hits every level alike
    reps: dict[int, list[dict]] = {s: [] for s in levels}
    for rep in range(args.repeats):
        for s in levels:
            t0 = time.time()
            r = run_one(s, args.seconds, args.override, args.eval_prompts, os.path.join(out_dir, f"staleness{s}-{rep}"))
            reps[s].append(r)
            print(f"  max_staleness={s} #{rep}: {r['steps']} steps, {r['samples_per_s']:.0f} samples/s, learner idle "
                  f"{r['learner_idle_frac']:.1%}, other work {r['foreign_cores']:.2f} cores "
                  f"({time.time() - t0:.0f}s with start-up and final eval)", flush=True)
    runs = {s: median_run(rs) for s, rs in reps.items()}

    sync = runs[0]
    print()
    print(format_table(
        ["max_staleness", "steps", "samples/s", "speedup", "lrn idle", "actor idle", "stale mean", "reward",
         "other cores", "samples/s of each repeat"],
        [[s, r["steps"], r["samples_per_s"], ratio(r["samples_per_s"], sync["samples_per_s"]),
          r["learner_idle_frac"], r["actor_idle_frac"], r["staleness_mean"], r["final_reward"], r["foreign_cores"],
          " ".join(f"{x:.0f}" for x in r["samples_per_s_all"])]
         for s, r in runs.items()]))
    print("\nwhere the training wall time went (seconds; generation = actor wall - actor waits):")
    print(format_table(
        ["max_staleness", "wall", "actor gen", "lrn compute", "lrn wait", "ws publish", "ws apply~", "step ms"],
        [[s, r["train_wall_s"], r["actor_gen_s"], r["learner_compute_s"], r["learner_wait_s"],
          r["weightsync_publish_s"], r["weightsync_apply_s_est"], 1e3 * r["step_s_mean"]]
         for s, r in runs.items()]))

    best = max((s for s in levels if s), key=lambda s: runs[s]["samples_per_s"])
    speedup = ratio(runs[best]["samples_per_s"], sync["samples_per_s"])
    met = speedup is not None and speedup >= 1.5 and runs[best]["learner_idle_frac"] < 0.15
    print(f"\nbest async: max_staleness={best}, speedup {speedup:.2f}x, learner idle "
          f"{runs[best]['learner_idle_frac']:.1%} -> target (>=1.5x, idle<15%) {'met' if met else 'NOT met'}; "
          f"load average after: {load_avg()[0]:.2f}")
    print(json.dumps(json_safe({
        "bench": "async_vs_sync", "speedup": speedup, "learner_idle_frac": runs[best]["learner_idle_frac"],
        "best_staleness": best, "target_met": met, "seconds": args.seconds, "repeats": args.repeats,
        "overrides": args.override,
        "runs": {str(s): r for s, r in runs.items()},
    })))
    return 0


if __name__ == "__main__":
    sys.exit(main())
