"""Self-distillation, the actor's half: a corpus of the policy's shortest correct answers per training prompt
(as sampled, EOS included); ``learner/sft.py`` fine-tunes the *base* model on it, so stage 2 starts short and right.
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import torch

from actor.curriculum import prompt_limit
from actor.evaluate import loaded, sample_k
from actor.tasks import Prompt, Task
from core.files import atomic_write

DRAWS_PER_PROMPT = 50  # a task with fewer distinct training prompts than asked for is an error


def is_correct(reward: float, finish: str) -> bool:
    """Rewarded and finished with EOS: a truncated sample that scores never learnt to stop."""
    return reward > 0.5 and finish == "stop"


def shortest_correct(samples, rewards) -> int | None:
    """Index of the shortest correct sample (:func:`is_correct`), the first on ties; None if none."""
    correct = [i for i, (s, r) in enumerate(zip(samples, rewards, strict=True)) if is_correct(r, s.finish_reason)]
    return min(correct, key=lambda i: len(samples[i].tokens), default=None)


def train_prompts(task: Task, n: int, seed: int) -> list[Prompt]:
    """``n`` distinct (by ``Prompt.id``) training prompts from a seeded rng, in draw order."""
    rng, found = random.Random(seed), {}
    for _ in range(n * DRAWS_PER_PROMPT):
        p = task.sample(rng, "train")
        found.setdefault(p.id, p)
        if len(found) == n:
            return list(found.values())
    raise ValueError(f"distill.prompts={n}: the task gave only {len(found)} distinct training prompts "
                     f"in {n * DRAWS_PER_PROMPT} draws")


def _row(p: Prompt, completion: list[int], compressed: bool = False) -> dict:
    return {"id": p.id, "tier": p.tier, "difficulty": p.difficulty, "prompt": [int(t) for t in p.tokens],
            "completion": [int(t) for t in completion], "compressed": compressed}


def accept_rewrites(prompts: list[Prompt], rows: list[dict], rewrites, rewards) -> int:
    """Replace (in place) each row's completion by its rewrite if correct and strictly shorter; the count."""
    accepted = 0
    for p, row, s, r in zip(prompts, rows, rewrites, rewards, strict=True):
        if is_correct(r, s.finish_reason) and len(s.tokens) < len(row["completion"]):
            row.update(_row(p, s.tokens, compressed=True))
            accepted += 1
    return accepted


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def build_corpus(cfg, policy_dir: str, out_path: str, progress=None) -> dict:
    """Sample ``policy_dir`` into the corpus at ``out_path``; its stats. ``progress(n)`` per n-prompt chunk."""
    dc, t0 = cfg.distill, time.time()
    torch.set_num_threads(cfg.actor.threads)
    with loaded(cfg, policy_dir) as (engine, task):
        if engine.env is not None:  # an SFT row has no mask: it would train the environment's tokens
            raise ValueError(f"task {cfg.task.name!r} runs multi-turn episodes: self-distillation does not "
                             "take them yet")
        prompts = train_prompts(task, dc.prompts, cfg.run.seed)
        samples, rewards = sample_k(engine, task, prompts, dc.samples, progress,
                                    [prompt_limit(cfg, p) for p in prompts])
        best = [shortest_correct(ss, rr) for ss, rr in zip(samples, rewards)]
        kept = [p for p, b in zip(prompts, best) if b is not None]
        rows = [_row(p, ss[b].tokens) for p, ss, b in zip(prompts, samples, best) if b is not None]
        selected, accepted = [len(r["completion"]) for r in rows], 0
        if dc.compress_prompt and rows:  # ask for each kept answer again, followed by the instruction
            eos, instruction = set(task.tok.eos_ids), task.tok.encode(dc.compress_prompt)
            rewrites = engine.generate([list(p.tokens) + [t for t in r["completion"] if t not in eos] + instruction
                                        for p, r in zip(kept, rows)])
            scores = task.rewards([(p, s.tokens) for p, s in zip(kept, rewrites)])
            accepted = accept_rewrites(kept, rows, rewrites, scores)
    atomic_write(out_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    seconds = time.time() - t0
    flat = [(s, r) for ss, rr in zip(samples, rewards) for s, r in zip(ss, rr)]
    return {"prompts": len(prompts), "samples": len(flat), "corpus": len(rows),
            "mean_length_all": _mean([len(s.tokens) for s, _ in flat]),
            "mean_length_correct": _mean([len(s.tokens) for s, r in flat if is_correct(r, s.finish_reason)]),
            "mean_length_selected": _mean(selected), "mean_length_kept": _mean([len(r["completion"]) for r in rows]),
            # pass@1 as actor/evaluate.py counts it (reward > 0.5), so it compares with eval figures
            "accuracy_policy": _mean([float(r > 0.5) for _, r in flat]),
            "compress_tried": len(rows) if dc.compress_prompt else 0, "compress_accepted": accepted,
            "seconds": round(seconds, 2), "prompts_per_s": round(len(prompts) / max(seconds, 1e-9), 2)}
