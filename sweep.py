"""``python run.py sweep``: short real trainings over a grid of settings, one table to choose from.

    python run.py sweep buffer.max_staleness=0,1,2,4 [more axes] [section.key=value ...]
                        [--config FILE] [--seeds N | --seed-list 0,3,7] [--minutes M]
                        [--out DIR] [--resume DIR]

A token ``section.key=v1,v2,...`` (two or more values, split on the commas outside ``[...]``,
``{...}`` and quotes) is a sweep axis; several axes give their cartesian product. Any other
``section.key=value`` is a fixed override for every training, as in ``run.py``. Each setting is
trained once per seed (``run.seed`` = 0..N-1, or ``--seed-list``), all seeds of the first round
before the second, so a sweep cut short still compares every setting. ``--minutes M`` gives
each training ``run.max_time_s = 60*M`` (and ``run.max_steps = 0`` unless given). Every training
is a full real job (``jobs.train``, then ``final_eval``) in ``OUT/<NN>-<setting>-seed<S>/``
(``OUT`` defaults to ``runs/sweep-<UTC timestamp>``) and leaves ``result.json`` there.

Per training, read from its ``metrics.jsonl`` (the names of ARCHITECTURE.md):

    samples/s   trained samples / seconds of training, from step 2 on (the first step waits for the
                actors to start): sum over those steps of learner/wait_s + learner/step_s
    reward      held-out eval/reward of final_model (final_eval); start: the first in-run eval
    p99@s       mean over steps of ratio/p99_by_staleness/<s>, per lag s that occurred
    drops       stale groups dropped: buffer/dropped_stale + learner/dropped_stale (last values)
    idle        learner idle fraction over the same steps: sum of wait_s / sum of (wait_s + step_s)

A setting's row is the mean over its seeds (drops: per training); the reward's spread is the
sample standard deviation over seeds (ddof=1). Rule (SPREAD_RULE): a setting is worse than the
best (highest mean final reward) beyond the seed spread when ``best mean - its mean > 2 x pooled
std`` of the two settings, ``pooled = sqrt(((n1-1) s1^2 + (n2-1) s2^2) / (n1 + n2 - 2))``.
With one seed the spread is unknown and the table says so: no setting can be called worse. The
JSON also has each setting's ``paired_diffs`` (its reward minus the best's, per seed):
``run.seed`` also picks the built-in tiny base model, so the spread over seeds includes
base-model variance, which the paired differences do not (pin ``model.path`` to compare RL
noise alone).

How to choose a staleness limit from the table: take the highest samples/s among the settings
whose reward is not worse than the best beyond the seed spread (``vs best`` says "within
spread"; the line under the table names it) and whose ratio p99 at the high lags stays moderate
(close to the lag-0 value; a p99 climbing toward the ratio truncation ``learner.eps_high``
means stale samples get truncated: a biased, noisier gradient). A larger limit only pays when
it buys samples/s, which shows as a lower learner idle fraction; drops say how much generated
work a small limit throws away. Two seeds give a rough spread: a "worse" verdict that matters
deserves more seeds or minutes.

``OUT/sweep.json`` holds the table (also the last stdout line, on one line), every run's result
and the plan; ``OUT/sweep.png`` plots samples/s, final reward (± std) and ratio p99 by lag.
Ctrl-C stops the running training cleanly (its roles stopped, as in ``run.py``) and reports the
finished ones; ``python run.py sweep --resume OUT`` continues the plan in ``OUT/plan.json``,
skipping every training whose ``result.json`` exists (an unfinished one is moved aside to
``<name>.interrupted`` and trained again from the start).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import itertools
import json
import logging
import math
import os
import re
import sys
import time

import msgspec

from core import config as C
from core.files import atomic_write

log = logging.getLogger("driftrl.sweep")
SPREAD_RULE = ("spread = sample std of the final held-out reward over seeds (ddof=1); a setting is "
               "worse than the best beyond the spread when best mean - its mean > 2 x pooled std "
               "of the two settings")
RESERVED = {"run.seed": "use --seeds N or --seed-list", "run.run_dir": "use --out DIR"}


class SweepError(ValueError):
    """A bad sweep argument; the message names the token."""


@dataclasses.dataclass(frozen=True)
class Axis:
    key: str
    values: tuple[str, ...]


@dataclasses.dataclass
class Plan:
    axes: list[Axis]
    fixed: list[str]
    seeds: list[int]
    minutes: float | None
    config: str | None
    out: str

    def settings(self) -> list[tuple[tuple[str, str], ...]]:
        """The cartesian product of the axes, first axis slowest."""
        keys = [a.key for a in self.axes]
        return [tuple(zip(keys, vals)) for vals in itertools.product(*(a.values for a in self.axes))]

    def runs(self) -> list[tuple[tuple, int, str]]:
        """``(setting, seed, directory name)`` in run order: seed-major, so every setting gets its
        first seed before any gets its second."""
        settings = self.settings()
        return [(s, seed, f"{i:02d}-{slug(s)}-seed{seed}") for seed in self.seeds for i, s in enumerate(settings)]


def label(setting) -> str:
    return " ".join(f"{k}={v}" for k, v in setting)


def slug(setting) -> str:
    """A directory-safe name of a setting (the last key part; the index prefix keeps it unique)."""
    text = "_".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in setting)
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)[:80]


# ---- parsing ---------------------------------------------------------------------------------


def split_values(text: str) -> list[str]:
    """Top-level commas separate values; those inside ``[...]``, ``{...}`` or quotes belong to
    one TOML literal (``learner.betas=[0.9,0.99]`` is one value, not an axis)."""
    parts, cur, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    return parts + ["".join(cur).strip()]


def parse_token(tok: str) -> Axis | str:
    """An :class:`Axis` for ``key=v1,v2,...``; the token itself for a fixed ``key=value``."""
    key, eq, raw = tok.partition("=")
    if not eq or not key.strip():
        raise SweepError(f"{tok!r} is not section.key=value or section.key=v1,v2,...")
    values = split_values(raw)
    if values == [""]:
        raise SweepError(f"{tok!r}: empty value list (give v1,v2,..., or \"\" for an empty string)")
    if len(values) == 1:
        return tok
    if "" in values:
        raise SweepError(f"axis {tok!r}: empty value in its list {values}")
    if len(set(values)) < len(values):
        raise SweepError(f"axis {tok!r}: a value is repeated")
    return Axis(key.strip(), tuple(values))


def parse_seeds(seeds: int | None, seed_list: str | None) -> list[int]:
    if seeds is not None and seed_list is not None:
        raise SweepError("give --seeds or --seed-list, not both")
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


def _check_keys(axes: list[Axis], fixed: list[str], minutes: float | None) -> None:
    """Each key once; the keys the sweep sets itself are not given."""
    keys = [a.key for a in axes] + [f.partition("=")[0].strip() for f in fixed]
    reserved = dict(RESERVED, **({"run.max_time_s": "--minutes sets it"} if minutes is not None else {}))
    for k in keys:
        if k in reserved:
            raise SweepError(f"`{k}` is set by the sweep: {reserved[k]}")
        if keys.count(k) > 1:
            raise SweepError(f"`{k}` is given more than once (as an axis or an override)")
    if not axes:
        raise SweepError("nothing to sweep: give at least one axis section.key=v1,v2,...")


def make_plan(tokens: list[str], seeds: list[int], minutes: float | None, config: str | None,
              out: str | None) -> Plan:
    if minutes is not None and not minutes > 0:
        raise SweepError(f"--minutes must be > 0, got {minutes}")
    parsed = [parse_token(t) for t in tokens]
    axes = [p for p in parsed if isinstance(p, Axis)]
    fixed = [p for p in parsed if isinstance(p, str)]
    _check_keys(axes, fixed, minutes)
    out = os.path.abspath(out or os.path.join("runs", "sweep-" + _dt.datetime.now(_dt.timezone.utc)
                                              .strftime("%Y%m%d-%H%M%S")))
    return Plan(axes, fixed, seeds, minutes, os.path.abspath(config) if config else None, out)


def given_keys(plan: Plan) -> set[str]:
    return {a.key for a in plan.axes} | {f.partition("=")[0].strip() for f in plan.fixed}


def overrides(plan: Plan, setting, seed: int) -> list[str]:
    """The overrides of one training: fixed, budget, the setting, the seed (later ones win)."""
    budget = []
    if plan.minutes is not None:
        budget.append(f"run.max_time_s={60.0 * plan.minutes!r}")
        if "run.max_steps" not in given_keys(plan):
            budget.append("run.max_steps=0")  # the time budget alone decides
    return [*plan.fixed, *budget, *(f"{k}={v}" for k, v in setting), f"run.seed={seed}"]


def configs(plan: Plan) -> list[tuple[tuple, int, str, C.Config]]:
    """Every training's config, built before the first starts: a bad key fails the sweep at once."""
    out = []
    for setting, seed, name in plan.runs():
        try:
            out.append((setting, seed, name, C.load(plan.config, overrides(plan, setting, seed))))
        except C.ConfigError as e:
            raise C.ConfigError(f"setting {label(setting)!r}: {e}") from None
    return out


def config_value(cfg: C.Config, key: str):
    """The resolved (typed) value of a dotted key."""
    node = msgspec.to_builtins(cfg)
    for part in key.split("."):
        node = node[part]
    return node


def plan_to_json(plan: Plan) -> dict:
    return {**dataclasses.asdict(plan), "axes": [[a.key, list(a.values)] for a in plan.axes]}


def plan_from_json(tree: dict) -> Plan:
    return Plan(**{**tree, "axes": [Axis(k, tuple(v)) for k, v in tree["axes"]]})


# ---- one training's numbers, from its metrics.jsonl ------------------------------------------


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def _last(records, key) -> float:
    vals = [r[key] for r in records if r.get(key) is not None]
    return float(max(vals)) if vals else 0.0  # cumulative counters: the largest is the last


def p99_by_lag(learner: list[dict]) -> dict[str, float]:
    prefix = "ratio/p99_by_staleness/"
    lags = sorted({int(k[len(prefix):]) for r in learner for k in r if k.startswith(prefix)})
    means = {str(s): _mean(r.get(f"{prefix}{s}") for r in learner) for s in lags}
    return {s: v for s, v in means.items() if v is not None}


def throughput(learner: list[dict], samples_per_step: int) -> dict:
    """samples/s and idle fraction from the second step on: the first step's wait is the actors'
    start-up (processes, weights, a first batch), alike for every setting and no part of the
    steady state a staleness limit changes."""
    steady = learner[1:]
    wait = sum(float(r.get("learner/wait_s") or 0.0) for r in steady)
    total = wait + sum(float(r.get("learner/step_s") or 0.0) for r in steady)
    if total <= 0:
        return {"steady_s": total, "samples_per_s": None, "idle_frac": None}
    return {"steady_s": total, "samples_per_s": len(steady) * samples_per_step / total, "idle_frac": wait / total}


def summarise(records: list[dict], samples_per_step: int) -> dict:
    """The sweep's numbers of one training (see the module docstring for each definition)."""
    learner = [r for r in records if r.get("role") == "learner" and r.get("learner/step") is not None]
    buffer_drops = _last([r for r in records if r.get("role") == "buffer"], "buffer/dropped_stale")
    learner_drops = _last(learner, "learner/dropped_stale")
    return {"steps": int(_last(learner, "learner/step")), "samples": len(learner) * samples_per_step,
            **throughput(learner, samples_per_step), "ratio_p99_by_lag": p99_by_lag(learner),
            "drops": {"buffer_stale": buffer_drops, "learner_stale": learner_drops,
                      "total": buffer_drops + learner_drops}}


def read_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- across seeds and settings ---------------------------------------------------------------


def _std(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def pooled_std(a: dict, b: dict) -> float | None:
    """Pooled sample std of two settings' final rewards; None without a degree of freedom."""
    df = a["runs"] + b["runs"] - 2
    if df < 1:
        return None
    var = sum((s["runs"] - 1) * (s["reward_final"]["std"] or 0.0) ** 2 for s in (a, b))
    return math.sqrt(var / df)


def aggregate_setting(lab: str, setting: dict, runs: list[dict]) -> dict:
    """One row: means over the setting's seeds; the reward with its spread."""
    rewards = [r["reward_final"] for r in runs]
    lags = sorted({s for r in runs for s in r["ratio_p99_by_lag"]}, key=int)
    return {"label": lab, "setting": setting, "runs": len(runs), "seeds": [r["seed"] for r in runs],
            "samples_per_s": _mean(r["samples_per_s"] for r in runs),
            "reward_final": {"mean": _mean(rewards), "std": _std(rewards),
                             "min": min(rewards), "max": max(rewards), "values": rewards},
            "reward_start": _mean(r["reward_start"] for r in runs),
            "ratio_p99_by_lag": {s: _mean(r["ratio_p99_by_lag"].get(s) for r in runs) for s in lags},
            "drops": _mean(r["drops"]["total"] for r in runs),
            "idle_frac": _mean(r["idle_frac"] for r in runs), "steps": _mean(r["steps"] for r in runs)}


def verdict(row: dict, best: dict) -> dict:
    """``row`` against the best setting under SPREAD_RULE."""
    diff = row["reward_final"]["mean"] - best["reward_final"]["mean"]
    pooled = pooled_std(row, best)
    worse = None if pooled is None else -diff > 2 * pooled
    text = ("best" if row is best else "spread unknown" if worse is None
            else "worse beyond spread" if worse else "within spread")
    return {"diff": diff, "pooled_std": pooled, "worse_beyond_spread": False if row is best else worse,
            "verdict": text, "paired_diffs": paired_diffs(row, best)}


def paired_diffs(row: dict, best: dict) -> dict[str, float]:
    """Per seed both settings ran: its reward minus the best's. A seed also fixes the built-in
    base model (model/basemodel.py), so these differences are free of base-model variance."""
    theirs = dict(zip(best["seeds"], best["reward_final"]["values"]))
    return {str(seed): r - theirs[seed] for seed, r in zip(row["seeds"], row["reward_final"]["values"])
            if seed in theirs}


def aggregate(results: list[dict]) -> list[dict]:
    """Rows in the order the settings first appear, each with its verdict against the best."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["label"], []).append(r)
    rows = [aggregate_setting(lab, runs[0]["setting"], runs) for lab, runs in groups.items()]
    if rows:
        best = max(rows, key=lambda r: r["reward_final"]["mean"])
        for row in rows:
            row["vs_best"] = verdict(row, best)
    return rows


def choice(rows: list[dict]) -> dict | None:
    """The fastest setting not worse than the best beyond the spread (None while unknown)."""
    if all(r["runs"] < 2 for r in rows) or any(r["vs_best"]["worse_beyond_spread"] is None for r in rows):
        return None
    ok = [r for r in rows if not r["vs_best"]["worse_beyond_spread"] and r["samples_per_s"] is not None]
    return max(ok, key=lambda r: r["samples_per_s"]) if ok else None


# ---- output ----------------------------------------------------------------------------------


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table_lags(rows: list[dict]) -> list[str]:
    return sorted({s for r in rows for s in r["ratio_p99_by_lag"]}, key=int)


def table_rows(rows: list[dict]) -> list[list[str]]:
    lags = table_lags(rows)
    head = ["setting", "runs", "samples/s", "final reward ± std", "start reward",
            *(f"p99@{s}" for s in lags), "drops", "idle", "steps", "vs best"]
    body = [[r["label"], str(r["runs"]), _fmt(r["samples_per_s"], ".1f"),
             f"{_fmt(r['reward_final']['mean'])} ± {_fmt(r['reward_final']['std'])}", _fmt(r["reward_start"]),
             *(_fmt(r["ratio_p99_by_lag"].get(s)) for s in lags), _fmt(r["drops"], ".1f"),
             _fmt(r["idle_frac"], ".2f"), _fmt(r["steps"], ".0f"),
             f"{r['vs_best']['diff']:+.3f} {r['vs_best']['verdict']}"] for r in rows]
    return [head, *body]


def render(rows: list[dict]) -> str:
    """The table, columns padded to their widest cell, then the rule and the pick."""
    cells = table_rows(rows)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    labels = [r["label"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    a.bar(labels, [r["samples_per_s"] or 0.0 for r in rows])
    a.set_title("trained samples/s")
    b.errorbar(labels, [r["reward_final"]["mean"] for r in rows],
               yerr=[r["reward_final"]["std"] or 0.0 for r in rows], fmt="o", capsize=4)
    for lab, r in zip(labels, rows):
        b.scatter([lab] * r["runs"], r["reward_final"]["values"], s=12, c="grey", zorder=3)
    b.set_title("final held-out reward (mean ± std over seeds; dots: seeds)")
    for r in rows:
        lags = list(r["ratio_p99_by_lag"])
        c.plot([int(s) for s in lags], [r["ratio_p99_by_lag"][s] for s in lags], "o-", label=r["label"])
    c.set(title="ratio p99 by staleness", xlabel="lag")
    c.legend(fontsize=7)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(plan: Plan, results: list[dict], failed: list[dict], interrupted: bool, wall_s: float) -> dict:
    rows = aggregate(results)
    pick = choice(rows) if rows else None
    return {"out": plan.out, "plan": plan_to_json(plan), "spread": "std over seeds (ddof=1)",
            "rule": SPREAD_RULE, "settings": rows, "pick": pick["label"] if pick else None,
            "lags": table_lags(rows), "runs": results, "failed": failed,
            "finished": len(results), "planned": len(plan.runs()), "interrupted": interrupted,
            "wall_s": wall_s, "runs_wall_s": sum(r["wall_s"] for r in results)}  # this call; every job's


# ---- running ---------------------------------------------------------------------------------


def run_one(cfg: C.Config, setting, seed: int, run_dir: str) -> dict:
    """One full real job (jobs.train, final_eval) and its ``result.json``."""
    import jobs  # the job is exactly ``python run.py``'s
    from actor.evaluate import final_eval

    t0 = time.time()
    result = jobs.train(cfg, run_dir)
    if result.interrupted:
        raise KeyboardInterrupt
    final = final_eval(result.run_dir)
    per_step = cfg.learner.groups_per_step * cfg.actor.group_size
    out = {"label": label(setting), "setting": {k: config_value(cfg, k) for k, _ in setting}, "seed": seed,
           "run_dir": result.run_dir, **summarise(read_records(result.run_dir), per_step),
           "reward_start": jobs.first_eval(result.run_dir), "reward_final": final["eval/reward"],
           "wall_s": time.time() - t0}
    atomic_write(os.path.join(result.run_dir, "result.json"), json.dumps(out, indent=1).encode())
    return out


def finished(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "result.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def move_aside(run_dir: str) -> None:
    """An unfinished training's directory (its checkpoints would resume it) goes out of the way."""
    n, dest = 1, f"{run_dir}.interrupted"
    while os.path.exists(dest):
        n, dest = n + 1, f"{run_dir}.interrupted-{n + 1}"
    os.rename(run_dir, dest)
    log.warning("unfinished training moved aside: %s", dest)


def execute(plan: Plan, todo) -> tuple[list[dict], list[dict], bool]:
    """Run (or pick up) every training in order; Ctrl-C ends the loop, a failed job is recorded."""
    results, failed = [], []
    try:
        for i, (setting, seed, name, cfg) in enumerate(todo):
            log.info("sweep %d/%d: %s seed %d", i + 1, len(todo), label(setting), seed)
            _one(plan, setting, seed, name, cfg, results, failed)
    except KeyboardInterrupt:
        return results, failed, True
    return results, failed, False


def _one(plan: Plan, setting, seed: int, name: str, cfg: C.Config, results: list, failed: list) -> None:
    """A finished training's result.json is taken as it is; otherwise it is trained (again)."""
    from core.launchers import RoleFailed
    from learner.contract import ContractError

    run_dir = os.path.join(plan.out, name)
    done = finished(run_dir)
    if done is not None:
        log.info("finished before: %s", run_dir)
        results.append(done)
        return
    if os.path.exists(run_dir):
        move_aside(run_dir)
    try:
        res = run_one(cfg, setting, seed, run_dir)
    except (RoleFailed, ContractError) as e:  # one broken setting must not end an overnight sweep
        log.error("sweep %s seed %d failed: %s", label(setting), seed, e)
        failed.append({"label": label(setting), "seed": seed, "run_dir": run_dir, "error": str(e)})
        return
    results.append(res)
    log.info("done in %.0fs: held-out reward %s -> %.3f, %s samples/s; %s", res["wall_s"],
             _fmt(res["reward_start"]), res["reward_final"], _fmt(res["samples_per_s"], ".1f"), run_dir)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="run.py sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML file with overrides of the defaults")
    ap.add_argument("--seeds", type=int, help="seeds 0..N-1 per setting (default 1)")
    ap.add_argument("--seed-list", help="comma-separated seeds instead of --seeds")
    ap.add_argument("--minutes", type=float, help="training budget per run (run.max_time_s = 60*M)")
    ap.add_argument("--out", help="sweep directory (default runs/sweep-<UTC timestamp>)")
    ap.add_argument("--resume", metavar="OUT", help="continue the sweep in OUT (its plan.json)")
    ap.add_argument("tokens", nargs="*", help="axes section.key=v1,v2,... and overrides section.key=value")
    return ap.parse_intermixed_args(argv)


def load_plan(ns: argparse.Namespace) -> Plan:
    """A new plan or, with --resume, the one in OUT/plan.json."""
    if ns.resume is None:
        plan = make_plan(ns.tokens, parse_seeds(ns.seeds, ns.seed_list), ns.minutes, ns.config, ns.out)
        if os.path.exists(os.path.join(plan.out, "plan.json")):  # its results belong to that plan
            raise SweepError(f"--out {plan.out} already holds a sweep: continue it with --resume "
                             f"{plan.out}, or give another --out")
        return plan
    given = [k for k in ("tokens", "seeds", "seed_list", "minutes", "config", "out") if getattr(ns, k)]
    if given:
        raise SweepError(f"--resume continues the plan in {ns.resume}/plan.json as it is: drop "
                         + ", ".join(given))
    path = os.path.join(os.path.abspath(ns.resume), "plan.json")
    if not os.path.exists(path):
        raise SweepError(f"--resume {ns.resume}: no plan.json there, not a sweep directory")
    with open(path) as f:
        return dataclasses.replace(plan_from_json(json.load(f)), out=os.path.dirname(path))


def save_plan(plan: Plan) -> None:
    """OUT/plan.json, once every training's config is known to be valid: what --resume reads."""
    os.makedirs(plan.out, exist_ok=True)
    path = os.path.join(plan.out, "plan.json")
    if not os.path.exists(path):
        atomic_write(path, json.dumps(plan_to_json(plan), indent=1).encode())


def finish(plan: Plan, results, failed, interrupted: bool, t0: float) -> int:
    """Print the table, write sweep.json and sweep.png; the JSON is the last stdout line."""
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


def main(argv: list[str]) -> int:
    """``run.py sweep``: the caller has set up logging and the Ctrl-C handler (run.main)."""
    t0 = time.time()
    try:
        plan = load_plan(parse(argv))
        todo = configs(plan)
    except (SweepError, C.ConfigError) as e:
        print(f"sweep error: {e}", file=sys.stderr)
        return 2
    save_plan(plan)
    log.info("sweep of %d trainings into %s", len(todo), plan.out)
    try:
        results, failed, interrupted = execute(plan, todo)
    except (C.ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return finish(plan, results, failed, interrupted, t0)
