"""Shared helpers for the learner/actor tests: one tiny pre-trained model per test process.

The model is built by the real ``ensure_base_model`` recipe (a couple of seconds at this size),
so the tests exercise the same code path as a run, only smaller. Built once per pytest process
into a private temporary directory and removed at exit, so tests never depend on, or write to,
the project's ``.cache``.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import numpy as np
import torch

from core import config as C
from core import messages as M

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "model.pretrain_steps=200"]


@functools.lru_cache(maxsize=None)
def _cache_dir() -> str:
    path = tempfile.mkdtemp(prefix="driftrl-tiny-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def tiny_cfg(*overrides: str) -> C.Config:
    """The default config with the tiny model; ``overrides`` are dotted ``key=value`` items."""
    return C.load(None, [f"model.cache_dir={_cache_dir()}", *TINY, *overrides])


@functools.lru_cache(maxsize=None)
def tiny_model_dir() -> str:
    from learner.basemodel import ensure_base_model

    torch.set_num_threads(1)
    return ensure_base_model(tiny_cfg())


def tiny_model():
    """A fresh FP32 copy of the tiny model (callers may mutate it)."""
    from learner.model import load_pretrained

    return load_pretrained(tiny_model_dir())


def make_group(prompt, completions, seq: int = 0, actor_id: str = "t", start_version: int = 0):
    """A RolloutGroup from ``prompt`` ids and ``(tokens, logprobs, versions, finish, reward)`` tuples."""
    comps = [M.make_completion(t, lp, v, f, r) for t, lp, v, f, r in completions]
    return M.RolloutGroup(actor_id=actor_id, seq=seq, group_id=f"{actor_id}-{seq}", task="arith", tier="default",
                          prompt_tokens=np.asarray(prompt, dtype=M.TOKEN_DTYPE).tobytes(), completions=comps,
                          start_version=start_version, created_at=0.0)


def groups_from_samples(prompts, samples, group_size: int, rewards=None):
    """Engine samples (``group_size`` consecutive per prompt) -> RolloutGroups."""
    groups = []
    for i, prompt in enumerate(prompts):
        chunk = samples[i * group_size:(i + 1) * group_size]
        rs = rewards[i] if rewards is not None else [0.0] * group_size
        groups.append(make_group(prompt, [(s.tokens, s.logprobs, s.versions, s.finish_reason, r)
                                          for s, r in zip(chunk, rs)], seq=i))
    return groups
