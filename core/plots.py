"""``python run.py plot [RUN_DIR]``: PNG figures of a run from its ``metrics.jsonl`` (a pipeline
directory: one figure across its RL stages), over the learner step; step -1 records (restarts, drawn
as vertical lines) go at the learner step nearest in time. A metric nobody logged says "not logged".
The last stdout line is ``{"plots": [paths]}``."""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import sys
from collections import defaultdict

from core.attach import metrics_path
from core.metrics import MERGED_FILE, FileTail, read_all
from core.monitor import BY_STALENESS, RESTARTS

# (file, figure title, panel title, [(metric, label), ...], log y): the figures of plain lines
LINE_FIGURES = (
    ("reward", "reward", "held-out and train reward",
     [("eval/reward", "held-out (eval/reward)"), ("reward/mean", "train (reward/mean)")], False),
    ("length", "response length", "response length (tokens)",
     [("length/mean", "mean"), ("length/p90", "p90"), ("length/p99", "p99"), ("length/max", "max")], False),
    ("ratio", "ratio π_learner/π_behaviour", "ratio quantiles",
     [("ratio/p50", "p50"), ("ratio/p99", "p99"), ("ratio/p999", "p99.9"), ("ratio/max", "max")], True),
    ("learner_idle", "learner idle", "learner idle fraction", [("learner/idle_frac", "idle_frac")], False),
)

Points = list[tuple[float, float]]


def load(run_dir: str) -> list:
    records = read_all(tail := FileTail(metrics_path(run_dir)))
    if tail.bad_lines or tail.values_dropped:  # too long, too deep, not JSON; inf or overlong lists
        print(f"plot: {tail.path}: {tail.bad_lines} lines and {tail.values_dropped} values skipped", file=sys.stderr)
    return records


def timeline(records: list):
    """``step_at(t)``: the step of the learner record nearest in time to ``t`` (None without one)."""
    pairs = sorted((r.time, r.step) for r in records if r.role == "learner" and r.step >= 0)
    times = [t for t, _ in pairs]

    def step_at(t: float) -> float | None:
        i = bisect.bisect_left(times, t)
        near = [j for j in (i - 1, i) if 0 <= j < len(times)]
        return float(pairs[min(near, key=lambda j: abs(times[j] - t))][1]) if near else None

    return step_at


def index(records: list) -> dict[str, dict[str, Points]]:
    """``{metric: {source: [(step, value), ...]}}`` of every finite scalar; source is role/id."""
    step_at, out = timeline(records), defaultdict(lambda: defaultdict(list))
    for rec in records:
        x = float(rec.step) if rec.step >= 0 else step_at(rec.time)
        if x is None:
            continue
        for k, v in rec.values.items():
            if isinstance(v, float) and math.isfinite(v):
                out[k][f"{rec.role}/{rec.id}"].append((x, v))
    return out


def restart_steps(records: list) -> list[tuple[float, str]]:
    """(step, role) of every restart: a ``run/restarts/<role>`` counter that went up."""
    step_at, seen, out = timeline(records), {}, []
    for rec in records:
        for k, v in rec.values.items():
            if k.startswith(RESTARTS) and isinstance(v, float) and v > seen.get(k, 0.0):
                seen[k] = v
                if (x := step_at(rec.time)) is not None:
                    out.append((x, k[len(RESTARTS):]))
    return out


def per_step(pts: Points) -> Points:
    """The mean at each step, in step order."""
    acc = defaultdict(list)
    for x, v in pts:
        acc[x].append(v)
    return [(x, sum(vs) / len(vs)) for x, vs in sorted(acc.items())]


def merged(idx: dict, key: str) -> Points:
    return per_step([p for pts in idx.get(key, {}).values() for p in pts])


def not_logged(ax, keys) -> None:
    ax.text(0.5, 0.5, "not logged:\n" + "\n".join(keys), ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set(xticks=[], yticks=[])


def draw_lines(ax, title: str, series: list[tuple[str, Points]], restarts, absent, log_y: bool = False) -> bool:
    """One line per non-empty series; False (``absent`` shown as "not logged") when all are empty."""
    ax.set_title(title)
    drawn = [(label, pts) for label, pts in series if pts]
    if not drawn:
        not_logged(ax, absent)
        return False
    for label, pts in drawn:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="." if len(pts) < 30 else None)
    ys = [p[1] for _, pts in drawn for p in pts]
    if log_y and min(ys) > 0 and max(ys) > 10 * min(ys):  # a max far off the quantiles
        ax.set_yscale("log")
    for i, (x, role) in enumerate(restarts):
        ax.axvline(x, color="red", linestyle="--", linewidth=1, alpha=0.7, label="restart" if i == 0 else None)
        ax.annotate(role, (x, 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="red",
                    rotation=90, va="top", ha="right")
    ax.set_xlabel("learner step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return True


def line_panel(ax, idx: dict, title: str, keys, restarts, log_y: bool = False) -> None:
    series = [(label, merged(idx, k)) for k, label in keys]
    missing = [k for (k, _), (_, pts) in zip(keys, series) if not pts]
    if draw_lines(ax, title, series, restarts, [k for k, _ in keys], log_y) and missing:
        ax.text(0.01, 0.01, "not logged: " + ", ".join(missing), transform=ax.transAxes, fontsize=7, color="gray")


def figures(records: list):
    import matplotlib.pyplot as plt

    idx, restarts = index(records), restart_steps(records)
    for name, title, ptitle, keys, log_y in LINE_FIGURES:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        line_panel(ax, idx, ptitle, keys, restarts, log_y)
        fig.suptitle(title)
        yield name, fig

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    a.set_title("staleness of trained samples (cumulative)")  # the learner's last staleness/hist
    hist = next((r.values["staleness/hist"] for r in reversed(records)
                 if isinstance(r.values.get("staleness/hist"), list)), [])
    counts = [c if math.isfinite(c) else 0.0 for c in hist]
    if any(counts):
        a.bar(range(len(counts)), counts, color="tab:blue")
        a.set(xlabel="staleness (policy versions)", ylabel="samples",  # at most 32 ticks: cheap to draw
              xticks=range(0, len(counts), max(1, len(counts) // 16)))
    else:
        not_logged(a, ["staleness/hist"])
    line_panel(b, idx, "staleness over steps", [("staleness/mean", "mean"), ("staleness/max", "max")], restarts)
    yield "staleness", fig

    fig, ax = plt.subplots(figsize=(8, 4.5))
    lags = sorted((int(k[len(BY_STALENESS):]), k) for k in idx
                  if k.startswith(BY_STALENESS) and k[len(BY_STALENESS):].isdecimal())
    series = [(f"staleness {lag}", merged(idx, k)) for lag, k in lags]
    draw_lines(ax, "ratio p99 by staleness", series, restarts, [BY_STALENESS + "<lag>"])
    yield "ratio_by_staleness", fig

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    actors = sorted(idx.get("actor/tokens_per_s", {}).items())
    series = [(f"{src.split('/', 1)[1]} (actor/tokens_per_s)", per_step(pts)) for src, pts in actors]
    series.append(("learner (learner/tokens_per_s)", merged(idx, "learner/tokens_per_s")))
    draw_lines(a, "tokens/s", series, restarts, ["actor/tokens_per_s", "learner/tokens_per_s"])
    line_panel(b, idx, "samples/s", [("learner/samples_per_s", "learner (learner/samples_per_s)")], restarts)
    yield "throughput", fig


PIPELINE_RL = ("rl1", "rl2", "tiers")
PIPELINE_PANELS = (("mean response length (tokens)", "length/mean"), ("ratio p99", "ratio/p99"),
                   ("held-out reward", "eval/reward"))


def pipeline_figure(pipeline_dir: str):
    """Length, ratio p99 and held-out reward of the RL stages in turn; a dashed line marks the distillation."""
    import matplotlib.pyplot as plt

    stages, offset = [], 0.0  # (stage, first step on the shared axis, {metric: points})
    for stage in PIPELINE_RL:
        if os.path.exists(os.path.join(pipeline_dir, stage, MERGED_FILE)):
            idx = index(load(os.path.join(pipeline_dir, stage)))
            series = {key: [(x + offset, v) for x, v in merged(idx, key)] for _, key in PIPELINE_PANELS}
            stages.append((stage, offset, series))
            offset = max((x for pts in series.values() for x, _ in pts), default=offset) + 1
    fig, axes = plt.subplots(1, len(PIPELINE_PANELS), figsize=(15, 4.5), squeeze=False)
    for ax, (title, key) in zip(axes[0], PIPELINE_PANELS):
        for i, (stage, start, series) in enumerate(stages):
            if series[key]:
                ax.plot(*zip(*series[key]), color=f"C{i}", label=stage, marker="." if key == "eval/reward" else None)
            if stage == "rl2":
                ax.axvline(start, color="gray", linestyle="--", linewidth=0.8)
                ax.annotate("distill", (start, 1), xycoords=("data", "axes fraction"), fontsize=8, va="top")
        ax.set(title=title, xlabel="learner step (stages in order)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            not_logged(ax, [key])
    fig.suptitle(f"pipeline {os.path.basename(os.path.abspath(pipeline_dir))}")
    return fig


def write_plots(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Every figure as ``<out_dir>/<name>.png`` (default ``run_dir/plots``); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipeline = os.path.exists(os.path.join(run_dir, "pipeline.json"))
    records = [] if pipeline else load(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in [("pipeline", pipeline_figure(run_dir))] if pipeline else figures(records):
        path = os.path.join(out_dir, f"{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="run.py plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?", default=os.path.join("runs", "latest"))
    ap.add_argument("--out", help="where to write the PNGs (default RUN_DIR/plots)")
    args = ap.parse_args(argv)
    try:
        paths = write_plots(args.run_dir, args.out)  # imports matplotlib before it reads anything
    except (ImportError, OSError) as e:  # OSError: no run, metrics.jsonl a directory or FIFO, an unwritable --out
        missing = isinstance(e, ImportError) and f"{e.name or e} is not installed: pip install -e '.[plot]'"
        print(f"plot: {missing or e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    print(json.dumps({"plots": paths}))
    return 0
