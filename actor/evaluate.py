"""Held-out evaluation: the actor's in-run eval, the run's final eval, and ``run.py eval`` (pass@1, pass@k).
Everything samples as the actors sample (the engine built from ``cfg.actor``, not a greedy variant), each
prompt under its tier's limit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict

import numpy as np
import torch

from actor import episodes
from actor.curriculum import prompt_limit
from actor.engines import Engine, make_engine
from actor.tasks import Task, make_task
from core import config as C
from core.metrics import MetricsWriter, merge_pending
from model.tokenizer import Tokenizer

SEQUENCES_PER_CALL = 256  # fills an engine batch, bounds its memory


@contextlib.contextmanager
def loaded(cfg, model_dir: str):
    """``(engine, task)`` of ``cfg`` on ``model_dir`` (with the task's environment), both closed on exit."""
    engine = make_engine(cfg.actor, model_dir, seed=cfg.run.seed)
    task = make_task(cfg.task, Tokenizer.from_dir(model_dir))
    engine.env = episodes.environment(task)
    try:
        yield engine, task
    finally:
        task.close()
        engine.close()


def evaluate(engine: Engine, task: Task, prompts, max_new_tokens: list[int] | None = None,
             extra: dict | None = None) -> tuple[float, float]:
    """Mean reward and length on a fixed held-out set; ``max_new_tokens``: each prompt's limit. ``extra`` gets
    the task's episode rates (``eval/tool/...``) when the engine runs episodes."""
    samples = engine.generate([list(p.tokens) for p in prompts], max_new_tokens=max_new_tokens)
    items = [(p, s.tokens) for p, s in zip(prompts, samples)]
    if extra is not None and engine.env is not None:
        extra.update({f"eval/{k}": v for k, v in task.episode_metrics(items).items()})
    return float(np.mean(task.rewards(items))), float(np.mean([len(s.tokens) for s in samples]))


def final_eval(run_dir: str) -> dict:
    """Held-out reward of ``run_dir/final_model``, written to its own metrics file and merged into
    ``metrics.jsonl`` (``eval/final`` = 1): the launcher's follower has stopped."""
    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        cfg = C.from_json(f.read())
    torch.set_num_threads(1)
    extra: dict = {}
    with loaded(cfg, os.path.join(run_dir, "final_model")) as (engine, task):
        prompts = task.eval_set(cfg.run.eval_prompts)
        reward, length = evaluate(engine, task, prompts, [prompt_limit(cfg, p) for p in prompts], extra)
    values = {"eval/reward": reward, "eval/length": length, **extra, "eval/final": 1.0}
    with MetricsWriter(run_dir, "launcher", "final_eval") as metrics:
        metrics.emit(-1, values)
    merge_pending(run_dir)
    return {"step": -1, "time": time.time(), "role": "launcher", "id": "final_eval", **values}


def pass_at(correct: np.ndarray) -> dict[str, float]:
    return {"pass@1": float(correct.mean()), "pass@k": float((correct.sum(axis=1) > 0).mean())}


def _split(prompts, correct, lengths, key) -> dict[str, dict]:
    rows = defaultdict(list)
    for i, p in enumerate(prompts):
        rows[str(key(p))].append(i)
    return {name: {**pass_at(correct[idx]), "mean_length": float(lengths[idx].mean()), "prompts": len(idx)}
            for name, idx in sorted(rows.items())}


def sample_k(engine: Engine, task: Task, prompts, k: int, progress=None,
             limits: list[int] | None = None) -> tuple[list[list], list[list[float]]]:
    """``k`` samples of every prompt and their rewards (a ``k``-list each), about ``SEQUENCES_PER_CALL``
    per engine call; ``progress(n)`` after each call with its number of prompts."""
    samples, rewards, chunk = [], [], max(1, SEQUENCES_PER_CALL // k)
    for start in range(0, len(prompts), chunk):
        part = [p for p in prompts[start:start + chunk] for _ in range(k)]
        budget = None if limits is None else [b for b in limits[start:start + chunk] for _ in range(k)]
        got = engine.generate([list(p.tokens) for p in part], max_new_tokens=budget)
        scored = task.rewards([(p, s.tokens) for p, s in zip(part, got)])
        samples += [got[i:i + k] for i in range(0, len(part), k)]
        rewards += [scored[i:i + k] for i in range(0, len(part), k)]
        if progress is not None:
            progress(len(part) // k)
    return samples, rewards


def task_report(cfg: C.Config, model_dir: str, k: int, progress_factory) -> dict:
    with loaded(cfg, model_dir) as (engine, task):
        prompts, t0 = task.eval_set(cfg.run.eval_prompts), time.time()
        with progress_factory(f"eval {cfg.task.name}", len(prompts)) as advance:
            samples, rewards = sample_k(engine, task, prompts, k, advance, [prompt_limit(cfg, p) for p in prompts])
    correct = (np.asarray(rewards, dtype=float).reshape(len(prompts), k) > 0.5).astype(float)
    lengths = np.asarray([[len(s.tokens) for s in ss] for ss in samples], dtype=float).reshape(len(prompts), k)
    return {**pass_at(correct), "k": k, "mean_length": float(lengths.mean()), "prompts": len(prompts),
            "seconds": round(time.time() - t0, 1), "by_tier": _split(prompts, correct, lengths, lambda p: p.tier),
            "by_difficulty": _split(prompts, correct, lengths, lambda p: p.difficulty)}
