"""Synthetic but well-formed RolloutGroups, for the buffer's tests and benchmark.

The arrays have the real wire dtypes and realistic content (token ids in a vocabulary, negative
log-probs, per-token versions that may step up mid-completion as after an in-flight update).
"""

from __future__ import annotations

import time

import numpy as np

from core.messages import RolloutGroup, make_completion


def make_group(actor_id: str, seq: int, *, completions: int = 8, tokens: int = 1024, version: int = 0,
               prompt_tokens: int = 32, rng: np.random.Generator | None = None,
               group_id: str | None = None, ragged: bool = True) -> RolloutGroup:
    """``completions`` x ``tokens``; with ``ragged`` every other completion stops early."""
    rng = np.random.default_rng(seq) if rng is None else rng
    comps = []
    for i in range(completions):
        n = tokens
        if ragged and i % 2:
            n = max(1, tokens - int(rng.integers(0, max(1, tokens // 2))))
        versions = np.full(n, version, dtype=np.int32)
        versions[n // 2:] += int(rng.integers(0, 2))  # an in-flight weight update, sometimes
        comps.append(make_completion(
            rng.integers(0, 32000, n), -rng.exponential(1.0, n), versions,
            "length" if n == tokens else "stop", float(rng.random() < 0.5),
        ))
    return RolloutGroup(
        actor_id=actor_id, seq=seq, group_id=group_id or f"{actor_id}-g{seq}", task="synth",
        tier="default", prompt_tokens=rng.integers(0, 32000, prompt_tokens).astype("<i4").tobytes(),
        completions=comps, start_version=version, created_at=time.time(),
    )
