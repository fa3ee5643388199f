"""Shared pieces of the end-to-end benches (bench/async_vs_sync.py, bench/vs_trl.py).

* pure helpers (tested in tests/test_bench_smoke.py): reading metrics.jsonl, turning a run's
  records into throughput / idle / where-the-time-went figures, threshold crossing, tables;
* one held-out evaluation used for every system: driftrl's own ``actor.evaluate.evaluate`` with a
  ``TorchEngine`` seeded identically, so two systems' rewards differ only by their weights;
* ``run_driftrl``: a whole driftrl job in-process (real role processes), optionally with a
  :class:`WeightObserver` that snapshots the published weights on a fixed wall-time grid through
  the same shared-memory transport the actors read, so driftrl's learning curve can be evaluated
  off the clock, exactly as the TRL side's.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from core import config as C  # noqa: E402  (core stays torch-free: the pure helpers need no torch)
from core.proc import learner_memory  # noqa: E402

# benches print their own table: no live view, no periodic status lines
BENCH_DEFAULTS = ("monitor.live=off", "monitor.refresh_s=3600")


# ---- pure helpers --------------------------------------------------------------------------------


def load_avg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (math.nan, math.nan, math.nan)


class CpuMeter:
    """CPU use while a block runs: this process and its reaped children ("own") vs. the whole
    machine, from /proc/stat. ``foreign_cores`` is what other work took, in cores; unlike the load
    average it does not count the bench's own just-finished run."""

    def __enter__(self):
        self._t, self._own, self._all = time.time(), self._own_s(), self._machine_s()
        return self

    def __exit__(self, *exc):
        wall = max(time.time() - self._t, 1e-9)
        own_s, all_s = self._own_s() - self._own, self._machine_s() - self._all
        self.result = {"wall_s": wall, "own_cpu_s": own_s, "own_cores": own_s / wall, "machine_cores": all_s / wall,
                       "foreign_cores": max(all_s - own_s, 0.0) / wall}
        return False

    @staticmethod
    def _own_s() -> float:
        import resource

        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    @staticmethod
    def _machine_s() -> float:
        try:
            with open("/proc/stat") as f:
                user, nice, system = (int(x) for x in f.readline().split()[1:4])
            return (user + nice + system) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return math.nan


def bench_config(overrides: list[str] | tuple = (), path: str | None = None) -> C.Config:
    return C.load(path, [*BENCH_DEFAULTS, *overrides])


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _sum(records: list[dict], key: str) -> float:
    return float(sum(r[key] for r in records if isinstance(r.get(key), (int, float))))


def learner_origin(records: list[dict]) -> float:
    """The learner's ``time/elapsed_s`` when its first step began: ``run.max_time_s`` (and so
    ``time/elapsed_s``) counts from the launch, which includes process start-up and model load
    (~7 s here); a bench's time axis starts at the first step (the learner's first publish)."""
    first = min((r for r in records if r.get("role") == "learner" and "learner/step" in r),
                key=lambda r: r["learner/step"])
    return float(first["time/elapsed_s"]) - float(first["learner/wait_s"]) - float(first["learner/step_s"])


def summarize_run(records: list[dict], groups_per_step: int, group_size: int) -> dict:
    """Throughput and where the wall time of one driftrl run went, from its metrics.jsonl.

    * samples/s = completions trained on / training wall time (learner ``time/elapsed_s``,
      counted from the learner's first publish, so process start-up is left out);
    * learner idle = sum of ``learner/wait_s`` / sum of (wait + step) over every step;
    * actor idle = (sum of ``actor/admission_wait_s`` + final cumulative ``actor/buffer_wait_s``)
      / training wall time, per actor, averaged over actors;
    * generation = training wall - actor idle (what the actor spent decoding, scoring, sending);
    * the learner's peak resident memory and the mapped shared memory in it (none: it writes weight versions unmapped).
    """
    lrn = sorted((r for r in records if r.get("role") == "learner" and "learner/step" in r),
                 key=lambda r: r["learner/step"])
    if not lrn:
        raise ValueError("no learner step records: the run trained nothing")
    steps = int(lrn[-1]["learner/step"])
    wall = float(lrn[-1]["time/elapsed_s"]) - learner_origin(records)
    wait, busy = _sum(lrn, "learner/wait_s"), _sum(lrn, "learner/step_s")
    publish = _sum(lrn, "weightsync/publish_s")
    actors: dict[str, list[dict]] = {}
    for r in records:
        if r.get("role") == "actor" and "actor/admission_wait_s" in r:
            actors.setdefault(r["id"], []).append(r)
    idle, apply_total = [], 0.0
    for recs in actors.values():
        adm = _sum(recs, "actor/admission_wait_s")
        buf = max((r.get("actor/buffer_wait_s", 0.0) for r in recs), default=0.0)
        idle.append((adm + buf) / wall if wall > 0 else math.nan)
        applies = [r["weightsync/apply_s"] for r in recs if r.get("weightsync/apply_s")]
        # one record per batch carries the last apply's duration; versions applied ~ steps
        apply_total += statistics.median(applies) * steps if applies else 0.0
    stale = [r["staleness/mean"] for r in lrn if isinstance(r.get("staleness/mean"), (int, float))]
    actor_idle = statistics.fmean(idle) if idle else math.nan
    mem = learner_memory(lrn) or {}
    return {
        "steps": steps,
        "samples": steps * groups_per_step * group_size,
        "train_wall_s": wall,
        "samples_per_s": steps * groups_per_step * group_size / wall if wall > 0 else math.nan,
        "step_s_mean": (wait + busy) / steps,
        "learner_idle_frac": wait / (wait + busy) if wait + busy > 0 else math.nan,
        "actor_idle_frac": actor_idle,
        "learner_wait_s": wait,
        "learner_compute_s": busy - publish,
        "weightsync_publish_s": publish,
        "weightsync_apply_s_est": apply_total,
        "actor_gen_s": wall * (1 - actor_idle) if idle else math.nan,
        "staleness_mean": statistics.fmean(stale) if stale else math.nan,
        "learner_peak_rss_mb": mem.get("peak_rss_mb"),
        "learner_shm_mb": mem.get("shm_mb"),
    }


def final_reward(records: list[dict]) -> float | None:
    for r in reversed(records):
        if r.get("eval/final") and isinstance(r.get("eval/reward"), (int, float)):
            return float(r["eval/reward"])
    return None


def version_times(records: list[dict]) -> dict[int, float]:
    """Learner wall time since its first step (:func:`learner_origin`) at which each policy
    version was published."""
    origin = learner_origin(records)
    return {int(r["learner/version"]): float(r["time/elapsed_s"]) - origin for r in records
            if r.get("role") == "learner" and "learner/version" in r and "time/elapsed_s" in r}


def time_to_threshold(curve: list[tuple[float, float]], threshold: float) -> float | None:
    """First time on a (time, reward) curve whose reward reaches ``threshold``; None if never."""
    for t, r in sorted(curve):
        if r >= threshold:
            return t
    return None


def reward_at(curve: list[tuple[float, float]], t: float) -> float | None:
    """Reward of the newest point at or before time ``t`` (what a run holds after ``t`` seconds)."""
    best = None
    for tt, r in sorted(curve):
        if tt <= t:
            best = r
    return best


def ratio(a, b) -> float | None:
    if a is None or b is None or not b or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


def format_table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    def line(cells) -> str:  # first column left-aligned (names), the rest right-aligned (numbers)
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, body)])


def json_safe(obj):
    """NaN -> None, recursively, so the last line is strict JSON."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# ---- evaluation: one function for every system ----------------------------------------------------


class HeldOutEval:
    """Held-out reward of a state dict (HF Qwen3 names), sampled exactly like a driftrl eval.

    Every call uses a fresh engine seeded with ``seed``: the same prompts and the same random
    stream, so two weight sets are compared on common random numbers.
    """

    def __init__(self, cfg: C.Config, num_prompts: int, threads: int = 1):
        from model.hf import load_pretrained

        self.cfg, self.threads = cfg, threads
        self.task = make_task(cfg)
        self.prompts = self.task.eval_set(num_prompts)
        self.model = load_pretrained(cfg.model.path)
        self.names = set(self.model.state_dict())

    def __call__(self, state: dict) -> tuple[float, float]:
        import torch

        from actor.evaluate import evaluate

        missing = self.names - set(state)
        if missing:
            raise KeyError(f"state dict lacks {sorted(missing)[:3]}...: not a Qwen3 of this shape")
        self.model.load_state_dict({k: v for k, v in state.items() if k in self.names}, strict=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # the same numerics for every system's eval
        try:
            return evaluate(make_engine(self.cfg, self.model), self.task, self.prompts)
        finally:
            torch.set_num_threads(threads)


def make_task(cfg: C.Config):
    """The configured task on the configured model's tokenizer."""
    from actor.tasks import make_task as make
    from model.tokenizer import Tokenizer

    return make(cfg.task, Tokenizer.from_dir(cfg.model.path))


def make_engine(cfg: C.Config, model=None, seed: int | None = None):
    """A TorchEngine as the actor builds it (``model`` instead of the model dir's weights)."""
    from actor.engines import make_engine as make
    from actor.engines.torch import TorchEngine
    from model.sampling import SamplingSpec
    from model.tokenizer import Tokenizer

    seed = cfg.run.seed if seed is None else seed
    if model is None:
        return make(cfg.actor, cfg.model.path, seed=seed)
    tok, a = Tokenizer.from_dir(cfg.model.path), cfg.actor
    return TorchEngine(model, SamplingSpec.of(a), eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                       max_new_tokens=a.max_new_tokens, seed=seed)


def engine_batch(cfg: C.Config, seed: int = 0):
    """One learner step's worth of real rollouts (``groups_per_step`` prompts x ``group_size``
    samples from the configured engine), collated as the learner receives them."""
    from learner.batching import collate

    return collate(engine_groups(cfg, seed), learner_version=0)


def engine_groups(cfg: C.Config, seed: int = 0) -> list:
    """:func:`engine_batch`'s groups, as an actor hands them over."""
    import random

    from core import messages as M

    task, rng = make_task(cfg), random.Random(seed)
    prompts = [task.sample(rng) for _ in range(cfg.learner.groups_per_step)]
    size = cfg.actor.group_size
    flat = make_engine(cfg, seed=seed).generate([list(p.tokens) for p in prompts for _ in range(size)])
    return [M.group_from_samples(flat[i * size:(i + 1) * size], [0.0] * size, actor_id="bench", seq=i,
                                 group_id=f"b{i}", task=task.name, tier=p.tier, prompt=p.tokens, start_version=0)
            for i, p in enumerate(prompts)]


# ---- running driftrl -------------------------------------------------------------------------------


def resolved_config(overrides: list[str] | tuple = (), path: str | None = None) -> C.Config:
    """Bench config (``path``: a config file, else the built-in job) with the base model built or
    located, so every run shares one model dir."""
    from jobs import resolve_model

    return resolve_model(bench_config(overrides, path))


def make_observer(cfg: C.Config, run_dir: str, every_s: float):
    """A Monitor that also snapshots the learner's published weights every ``every_s`` seconds of
    learner wall time, read through the shared-memory transport (a second reader beside the
    actors), opened only for each copy so that the learner recycles its files as in any run."""
    from core.monitor import Monitor

    class WeightObserver(Monitor):
        def __init__(self):
            super().__init__(cfg, live=False)
            self.snapshots: list[tuple[int, dict]] = []  # (version, state dict)
            self._next_t, self._params = every_s, None

        def update(self, records):
            super().update(records)
            elapsed = [r.values["time/elapsed_s"] for r in records
                       if r.role == "learner" and "time/elapsed_s" in r.values]
            if elapsed and max(elapsed) >= self._next_t:
                self._snapshot()
                while self._next_t <= max(elapsed):
                    self._next_t += every_s

        def _snapshot(self):
            from model.hf import load_pretrained
            from weightsync.base import make_subscriber

            if self._params is None:
                self._params = load_pretrained(cfg.model.path).state_dict()
            try:  # held only for the copy: the learner then recycles its files as in a run with no observer
                sub = make_subscriber(cfg, run_dir, timeout_s=5)
            except TimeoutError:  # the learner has ended and removed its versions (its final_model closes the curve)
                return
            try:
                version = sub.apply(self._params)
            finally:
                sub.close()
            if version is not None:
                self.snapshots.append((version, {k: v.clone() for k, v in self._params.items()}))

    return WeightObserver()


def run_driftrl(cfg: C.Config, run_dir: str, snapshot_every_s: float = 0.0):
    """One driftrl job, then run.py's final held-out eval. Returns (RunResult, records, snapshots)."""
    from actor.evaluate import final_eval
    from jobs import train

    monitor = make_observer(cfg, run_dir, snapshot_every_s) if snapshot_every_s else None
    result = train(cfg, run_dir, monitor=monitor)
    if result.interrupted:
        raise KeyboardInterrupt
    bad = {k: v for k, v in result.returncodes.items() if v not in (0, -15)}
    if bad:
        print(f"warning: role exit codes {bad} (logs in {run_dir}/logs)", file=sys.stderr)
    final_eval(run_dir)
    return result, read_metrics(run_dir), (monitor.snapshots if monitor is not None else [])
