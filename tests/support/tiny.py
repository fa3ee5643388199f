"""Shared helpers for the learner/actor tests: one tiny pre-trained model per test process.

The model is built by the real base-model recipe (``ArithTask.base_model``, a couple of
seconds at this size), so the tests exercise the same code path as a run, only smaller. Built
once per pytest process into a private temporary directory and removed at exit, so tests never
depend on, or write to, the project's ``.cache``.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import msgspec
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


def tiny_cfg(*overrides: str, resolved: bool = True) -> C.Config:
    """The default config with the tiny model (``model.path`` set unless not ``resolved``);
    ``overrides`` are dotted ``key=value`` items."""
    cfg = C.load(None, [f"model.cache_dir={_cache_dir()}", *TINY, *overrides])
    if resolved and not cfg.model.path:
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=tiny_model_dir()))
    return cfg


@functools.lru_cache(maxsize=None)
def tiny_model_dir() -> str:
    from actor.tasks.arith import ArithTask

    torch.set_num_threads(1)
    return ArithTask.base_model(tiny_cfg(resolved=False))


def tiny_model():
    """A fresh FP32 copy of the tiny model (callers may mutate it)."""
    from model.hf import load_pretrained

    return load_pretrained(tiny_model_dir())


def tiny_tokenizer():
    from model.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_model_dir())


def tiny_task(*overrides: str):
    from actor.tasks import make_task

    return make_task(tiny_cfg(*overrides).task, tiny_tokenizer())


def tiny_engine(model=None, dtype: str = "float32", seed: int = 0, **spec):
    """A TorchEngine on the tiny model (or ``model``); ``spec``: temperature/top_k/top_p."""
    from actor.engines.torch import TorchEngine
    from model.sampling import SamplingSpec

    tok = tiny_tokenizer()
    return TorchEngine(model if model is not None else tiny_model(), SamplingSpec(**spec), eos_ids=tok.eos_ids,
                       pad_id=tok.pad_id, max_new_tokens=8, dtype=dtype, seed=seed)


def make_group(prompt, completions, seq: int = 0, actor_id: str = "t", start_version: int = 0):
    """A RolloutGroup from ``prompt`` ids and ``(tokens, logprobs, versions, finish, reward)`` tuples."""
    comps = [M.make_completion(t, lp, v, f, r) for t, lp, v, f, r in completions]
    return M.RolloutGroup(actor_id=actor_id, seq=seq, group_id=f"{actor_id}-{seq}", task="arith", tier="default",
                          prompt_tokens=np.asarray(prompt, dtype=M.TOKEN_DTYPE).tobytes(), completions=comps,
                          start_version=start_version, created_at=0.0)


def groups_from_samples(prompts, samples, group_size: int, rewards=None):
    """Engine samples (``group_size`` consecutive per prompt) -> RolloutGroups."""
    return [M.group_from_samples(samples[i * group_size:(i + 1) * group_size],
                                 rewards[i] if rewards is not None else [0.0] * group_size, actor_id="t", seq=i,
                                 group_id=f"t-{i}", task="arith", tier="default", prompt=p, start_version=0)
            for i, p in enumerate(prompts)]
