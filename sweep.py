"""``python run.py sweep``: short real trainings over a grid of settings, one table to choose from.

``section.key=v1,v2,...`` is an axis (commas inside ``[...]``, ``{...}`` or quotes do not split), several give
their product, every setting's first seed before any second; ``section.key=value`` is fixed. ``--minutes M``:
``run.max_time_s = 60*M`` (``run.max_steps = 0`` unless given). From step 2 on: samples/s = samples /
sum(learner/wait_s + step_s), idle = the wait share; p99@s = mean ratio/p99_by_staleness/<s>; drops = buffer +
learner dropped_stale; reward = final_eval's. A row is the mean over seeds (``run.seed`` also picks the built-in
base model: ``paired_diffs`` exclude that). ``OUT/sweep.json`` (the last stdout line) and ``OUT/sweep.png`` hold
the table; ``--resume OUT`` continues ``OUT/plan.json``, an unfinished training moved aside.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import re
import statistics
import time

import msgspec

from core import config as C
from core import launchers
from core.files import atomic_write, read_json

log = logging.getLogger("driftrl.sweep")
SPREAD_RULE = ("spread = sample std of the final held-out reward over seeds (ddof=1); a setting is worse than "
               "the best beyond the spread when best mean - its mean > 2 x pooled std of the two settings")
RESERVED = {"run.seed": "use --seeds N or --seed-list", "run.run_dir": "use --out DIR"}
SweepError = C.ConfigError  # a bad sweep argument: the message names the token
Axis = collections.namedtuple("Axis", "key values")  # values: a tuple of strings


@dataclasses.dataclass
class Plan:
    axes: list[Axis]
    fixed: list[str]
    seeds: list[int]
    minutes: float | None
    config: str | None
    out: str

    def runs(self) -> list[tuple[tuple, int, str]]:
        """``(setting, seed, directory name)``: the axes' product (first axis slowest), seed-major."""
        grid = list(itertools.product(*([(a.key, v) for v in a.values] for a in self.axes)))
        return [(s, seed, f"{i:02d}-{slug(s)}-seed{seed}") for seed in self.seeds for i, s in enumerate(grid)]


def label(setting) -> str:
    return " ".join(f"{k}={v}" for k, v in setting)


def slug(setting) -> str:
    """A directory-safe name of a setting (the index prefix keeps it unique)."""
    text = "_".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in setting)
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)[:80]


def split_values(text: str) -> list[str]:
    """Split on the commas outside ``[...]``, ``{...}`` and quotes (one TOML literal stays whole)."""
    parts, start, depth, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
        else:
            depth += (ch in "[{") - (ch in "]}")
    return parts + [text[start:].strip()]


def parse_token(tok: str) -> Axis | str:
    """An :class:`Axis` for ``key=v1,v2,...``; the token itself for a fixed ``key=value``."""
    key, eq, raw = tok.partition("=")
    if not eq or not key.strip():
        raise SweepError(f"{tok!r} is not section.key=value or section.key=v1,v2,...")
    values = split_values(raw)
    if "" in values:
        raise SweepError(f"{tok!r}: empty value list or an empty value in it {values} (give \"\" for an empty string)")
    if len(values) == 1:
        return tok
    if len(set(values)) < len(values):
        raise SweepError(f"axis {tok!r}: a value is repeated")
    return Axis(key.strip(), tuple(values))


def parse_seeds(seeds: int | None, seed_list: str | None) -> list[int]:
    if seed_list is None:
        if seeds is not None and seeds < 1:
            raise SweepError(f"--seeds must be >= 1, got {seeds}")
        return list(range(1 if seeds is None else seeds))
    try:
        out = [int(s) for s in seed_list.split(",")]
    except ValueError:
        raise SweepError(f"--seed-list {seed_list!r}: not a comma-separated list of integers") from None
    if len(set(out)) < len(out):
        raise SweepError(f"--seed-list {seed_list!r}: a seed is repeated")
    return out


def make_plan(tokens: list[str], seeds: list[int], minutes: float | None, config: str | None, out: str | None) -> Plan:
    if minutes is not None and not minutes > 0:
        raise SweepError(f"--minutes must be > 0, got {minutes}")
    parsed = [parse_token(t) for t in tokens]
    axes, fixed = [p for p in parsed if isinstance(p, Axis)], [p for p in parsed if isinstance(p, str)]
    keys = [a.key for a in axes] + [f.partition("=")[0].strip() for f in fixed]
    reserved = dict(RESERVED, **({"run.max_time_s": "--minutes sets it"} if minutes is not None else {}))
    for k in keys:
        if k in reserved:
            raise SweepError(f"`{k}` is set by the sweep: {reserved[k]}")
        if keys.count(k) > 1:
            raise SweepError(f"`{k}` is given more than once (as an axis or an override)")
    if not axes:
        raise SweepError("nothing to sweep: give at least one axis section.key=v1,v2,...")
    out = os.path.abspath(out or launchers.new_run_dir(prefix="sweep-"))
    return Plan(axes, fixed, seeds, minutes, os.path.abspath(config) if config else None, out)


def configs(plan: Plan) -> list[tuple[tuple, int, str, C.Config]]:
    """Every training's config, built before the first starts: a bad key fails the sweep at once.
    Overrides: the time budget (alone, unless run.max_steps is given), fixed, setting, seed (later win)."""
    budget = [] if plan.minutes is None else [f"run.max_time_s={60.0 * plan.minutes!r}", "run.max_steps=0"]
    out = []
    for setting, seed, name in plan.runs():
        try:
            cfg = C.load(plan.config, [*budget, *plan.fixed, *(f"{k}={v}" for k, v in setting), f"run.seed={seed}"])
            out.append((setting, seed, name, cfg))
        except C.ConfigError as e:
            raise C.ConfigError(f"setting {label(setting)!r}: {e}") from None
    return out


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def _last(records, key) -> float:  # cumulative counters: the largest is the last
    return float(max((r[key] for r in records if r.get(key) is not None), default=0.0))


def summarise(records: list[dict], samples_per_step: int) -> dict:
    """The sweep's numbers of one training (module docstring)."""
    learner = [r for r in records if r.get("role") == "learner" and r.get("learner/step") is not None]
    steady = learner[1:]  # the first step's wait is the actors' start-up, alike for every setting
    wait = sum(float(r.get("learner/wait_s") or 0.0) for r in steady)
    total = wait + sum(float(r.get("learner/step_s") or 0.0) for r in steady)
    prefix = "ratio/p99_by_staleness/"
    lags = sorted({int(k[len(prefix):]) for r in learner for k in r if k.startswith(prefix)})
    p99 = {str(s): v for s in lags if (v := _mean(r.get(f"{prefix}{s}") for r in learner)) is not None}
    drops = {"buffer_stale": _last([r for r in records if r.get("role") == "buffer"], "buffer/dropped_stale"),
             "learner_stale": _last(learner, "learner/dropped_stale")}
    return {"steps": int(_last(learner, "learner/step")), "samples": len(learner) * samples_per_step,
            "steady_s": total, "samples_per_s": len(steady) * samples_per_step / total if total > 0 else None,
            "idle_frac": wait / total if total > 0 else None, "ratio_p99_by_lag": p99,
            "drops": {**drops, "total": sum(drops.values())}}


def verdict(row: dict, best: dict) -> dict:
    """``row`` against the best setting under SPREAD_RULE, with its per-seed paired differences."""
    diff = row["reward_final"]["mean"] - best["reward_final"]["mean"]
    df = row["runs"] + best["runs"] - 2
    var = sum((s["runs"] - 1) * (s["reward_final"]["std"] or 0.0) ** 2 for s in (row, best))
    pooled = math.sqrt(var / df) if df >= 1 else None
    worse = None if pooled is None else -diff > 2 * pooled
    text = ("best" if row is best else "spread unknown" if worse is None
            else "worse beyond spread" if worse else "within spread")
    theirs = dict(zip(best["seeds"], best["reward_final"]["values"]))
    paired = {str(s): r - theirs[s] for s, r in zip(row["seeds"], row["reward_final"]["values"]) if s in theirs}
    return {"diff": diff, "pooled_std": pooled, "worse_beyond_spread": False if row is best else worse,
            "verdict": text, "paired_diffs": paired}


def aggregate(results: list[dict]) -> list[dict]:
    """A row per setting (in the order they first appear): means over seeds, a verdict against the best."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["label"], []).append(r)
    rows = []
    for lab, runs in groups.items():
        rewards, lags = [r["reward_final"] for r in runs], table_lags(runs)
        std = statistics.stdev(rewards) if len(runs) > 1 else None  # ddof=1
        rows.append({"label": lab, "setting": runs[0]["setting"], "runs": len(runs), "seeds": [r["seed"] for r in runs],
                     "samples_per_s": _mean(r["samples_per_s"] for r in runs),
                     "reward_final": {"mean": _mean(rewards), "std": std, "min": min(rewards), "max": max(rewards),
                                      "values": rewards},
                     "reward_start": _mean(r["reward_start"] for r in runs),
                     "ratio_p99_by_lag": {s: _mean(r["ratio_p99_by_lag"].get(s) for r in runs) for s in lags},
                     "drops": _mean(r["drops"]["total"] for r in runs),
                     "idle_frac": _mean(r["idle_frac"] for r in runs), "steps": _mean(r["steps"] for r in runs)})
    best = max(rows, key=lambda r: r["reward_final"]["mean"], default=None)
    for row in rows:
        row["vs_best"] = verdict(row, best)
    return rows


def choice(rows: list[dict]) -> dict | None:
    """The fastest setting not worse than the best beyond the spread (None while unknown)."""
    if all(r["runs"] < 2 for r in rows) or any(r["vs_best"]["worse_beyond_spread"] is None for r in rows):
        return None
    ok = [r for r in rows if not r["vs_best"]["worse_beyond_spread"] and r["samples_per_s"] is not None]
    return max(ok, key=lambda r: r["samples_per_s"]) if ok else None


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table_lags(rows: list[dict]) -> list[str]:
    return sorted({s for r in rows for s in r["ratio_p99_by_lag"]}, key=int)


def render(rows: list[dict]) -> str:
    lags = table_lags(rows)
    head = ["setting", "runs", "samples/s", "final reward ± std", "start reward",
            *(f"p99@{s}" for s in lags), "drops", "idle", "steps", "vs best"]
    cells = [head] + [[r["label"], str(r["runs"]), _fmt(r["samples_per_s"], ".1f"),
                       f"{_fmt(r['reward_final']['mean'])} ± {_fmt(r['reward_final']['std'])}",
                       _fmt(r["reward_start"]), *(_fmt(r["ratio_p99_by_lag"].get(s)) for s in lags),
                       _fmt(r["drops"], ".1f"), _fmt(r["idle_frac"], ".2f"), _fmt(r["steps"], ".0f"),
                       f"{r['vs_best']['diff']:+.3f} {r['vs_best']['verdict']}"] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    pick = choice(rows)
    one_seed = rows and all(r["runs"] < 2 for r in rows)
    note = ("spread unknown: one seed per setting, so no difference can be told from seed noise "
            "(rerun with --seeds 2 or more)" if one_seed else f"rule: {SPREAD_RULE}")
    end = (f"pick: {pick['label']}: the highest samples/s whose reward is within the seed spread of the "
           "best; check its high-lag ratio p99 stays moderate" if pick else "pick: none (spread unknown)")
    return "\n".join([*lines, note, end])


def plot(rows: list[dict], path: str) -> str | None:
    """samples/s, final reward ± std, ratio p99 by lag; None (and a log line) without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no backend, no global figure to close
    except ImportError:
        log.warning("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    labels = [r["label"] for r in rows]
    fig = Figure(figsize=(15, 4.5))
    a, b, c = fig.subplots(1, 3)
    a.bar(labels, [r["samples_per_s"] or 0.0 for r in rows])
    a.set_title("trained samples/s")
    b.errorbar(labels, [r["reward_final"]["mean"] for r in rows],
               yerr=[r["reward_final"]["std"] or 0.0 for r in rows], fmt="o", capsize=4)
    b.set_title("final held-out reward (mean ± std over seeds; dots: seeds)")
    for lab, r in zip(labels, rows):
        b.scatter([lab] * r["runs"], r["reward_final"]["values"], s=12, c="grey", zorder=3)
        c.plot([int(s) for s in r["ratio_p99_by_lag"]], list(r["ratio_p99_by_lag"].values()), "o-", label=lab)
    c.set(title="ratio p99 by staleness", xlabel="lag")
    c.legend(fontsize=7)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def report(plan: Plan, results: list[dict], failed: list[dict], interrupted: bool, wall_s: float) -> dict:
    rows = aggregate(results)
    pick = choice(rows)
    return {"out": plan.out, "plan": dataclasses.asdict(plan), "spread": "std over seeds (ddof=1)", "rule": SPREAD_RULE,
            "settings": rows, "pick": pick["label"] if pick else None, "lags": table_lags(rows), "runs": results,
            "failed": failed, "finished": len(results), "planned": len(plan.runs()), "interrupted": interrupted,
            "wall_s": wall_s, "runs_wall_s": sum(r["wall_s"] for r in results)}  # this call; every job's


def run_one(cfg: C.Config, setting, seed: int, run_dir: str) -> dict:
    """One full real job (jobs.train, final_eval) and its ``result.json``, or the one written before."""
    if (done := read_json(os.path.join(run_dir, "result.json"))) is not None:
        log.info("finished before: %s", run_dir)
        return done
    if os.path.exists(run_dir):
        move_aside(run_dir)
    import jobs  # the job is exactly ``python run.py``'s
    from actor.evaluate import final_eval

    t0 = time.time()
    result = jobs.train(cfg, run_dir)
    if result.interrupted:
        raise KeyboardInterrupt
    final = final_eval(result.run_dir)
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    tree = msgspec.to_builtins(cfg)  # each axis key's resolved (typed) value:
    resolved = {k: functools.reduce(dict.__getitem__, k.split("."), tree) for k, _ in setting}
    out = {"label": label(setting), "setting": resolved, "seed": seed, "run_dir": result.run_dir,
           **summarise(records, cfg.learner.groups_per_step * cfg.actor.group_size),
           "reward_start": jobs.first_eval(result.run_dir), "reward_final": final["eval/reward"],
           "wall_s": time.time() - t0}
    atomic_write(os.path.join(result.run_dir, "result.json"), json.dumps(out, indent=1).encode())
    log.info("done in %.0fs: held-out reward %s -> %.3f, %s samples/s; %s", out["wall_s"],
             _fmt(out["reward_start"]), out["reward_final"], _fmt(out["samples_per_s"], ".1f"), run_dir)
    return out


def move_aside(run_dir: str) -> None:
    """An unfinished training's directory (its checkpoints would resume it) goes out of the way."""
    dests = (f"{run_dir}.interrupted" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
    dest = next(d for d in dests if not os.path.exists(d))
    os.rename(run_dir, dest)
    log.warning("unfinished training moved aside: %s", dest)


def execute(plan: Plan, todo) -> tuple[list[dict], list[dict], bool]:
    """Every training in order; a failed job is recorded, as one broken setting must not end an overnight sweep."""
    from learner.contract import ContractError

    results, failed = [], []
    try:
        for i, (setting, seed, name, cfg) in enumerate(todo):
            log.info("sweep %d/%d: %s seed %d", i + 1, len(todo), label(setting), seed)
            run_dir = os.path.join(plan.out, name)
            try:
                results.append(run_one(cfg, setting, seed, run_dir))
            except (launchers.RoleFailed, ContractError) as e:
                log.error("sweep %s seed %d failed: %s", label(setting), seed, e)
                failed.append({"label": label(setting), "seed": seed, "run_dir": run_dir, "error": str(e)})
    except KeyboardInterrupt:
        return results, failed, True
    return results, failed, False


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="run.py sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML file with overrides of the defaults")
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=int, help="seeds 0..N-1 per setting (default 1)")
    seeds.add_argument("--seed-list", help="comma-separated seeds instead of --seeds")
    ap.add_argument("--minutes", type=float, help="training budget per run (run.max_time_s = 60*M)")
    ap.add_argument("--out", help="sweep directory (default runs/sweep-<UTC timestamp>)")
    ap.add_argument("--resume", metavar="OUT", help="continue the sweep in OUT (its plan.json)")
    ap.add_argument("tokens", nargs="*", help="axes section.key=v1,v2,... and overrides section.key=value")
    return ap.parse_intermixed_args(argv)


def load_plan(ns: argparse.Namespace) -> Plan:
    if ns.resume is None:
        plan = make_plan(ns.tokens, parse_seeds(ns.seeds, ns.seed_list), ns.minutes, ns.config, ns.out)
        if os.path.exists(os.path.join(plan.out, "plan.json")):  # its results belong to that plan
            raise SweepError(f"--out {plan.out} already holds a sweep: continue it with --resume "
                             f"{plan.out}, or give another --out")
        return plan
    given = [k for k in ("tokens", "seeds", "seed_list", "minutes", "config", "out") if getattr(ns, k)]
    if given:
        raise SweepError(f"--resume continues {ns.resume}/plan.json as it is: drop {', '.join(given)}")
    out = os.path.abspath(ns.resume)
    tree = read_json(os.path.join(out, "plan.json"))
    if tree is None:
        raise SweepError(f"--resume {ns.resume}: no plan.json there, not a sweep directory")
    return Plan(**{**tree, "out": out, "axes": [Axis(k, tuple(v)) for k, v in tree["axes"]]})


def save_plan(plan: Plan) -> None:
    """OUT/plan.json, once every training's config is known to be valid: what --resume reads."""
    os.makedirs(plan.out, exist_ok=True)
    path = os.path.join(plan.out, "plan.json")
    if not os.path.exists(path):
        atomic_write(path, json.dumps(dataclasses.asdict(plan), indent=1).encode())


def main(argv: list[str]) -> int:
    """``run.py sweep``; run.main set up logging, the Ctrl-C handler and failure_exit (a bad argument: exit 2)."""
    t0 = time.time()
    plan = load_plan(parse(argv))
    todo = configs(plan)
    save_plan(plan)
    log.info("sweep of %d trainings into %s", len(todo), plan.out)
    results, failed, interrupted = execute(plan, todo)  # a config error mid-way: run.failure_exit
    rep = report(plan, results, failed, interrupted, time.time() - t0)
    if results:
        print(f"sweep {plan.out}: {len(results)} of {rep['planned']} trainings, seeds {plan.seeds}, "
              + (f"{plan.minutes:g} min each" if plan.minutes else "the config's budget each"))
        print(render(rep["settings"]))
        rep["plot"] = plot(rep["settings"], os.path.join(plan.out, "sweep.png"))
    if interrupted:
        print(f"interrupted: {len(results)} of {rep['planned']} trainings finished; continue with: "
              f"python run.py sweep --resume {plan.out}")
    atomic_write(os.path.join(plan.out, "sweep.json"), json.dumps(rep, indent=1).encode())
    print(json.dumps(rep))
    return 130 if interrupted else (1 if failed else 0)
