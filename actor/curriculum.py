"""Response-length limits: the curriculum's limit over a run, and the one rule for a prompt's limit.

A prompt's limit (:func:`prompt_limit`, used by the worker and by every evaluation) is the
smallest of ``actor.max_new_tokens`` (what the buffer admits), its tier's
``task.tier_max_new_tokens`` (a tier without an entry keeps the cap) and, during training, the
curriculum's current limit. Starting short and growing lets RL first learn to answer inside a
small budget, then spend the longer budget on working that pays (the scratch task).

The curriculum (``actor.length_schedule``):

- ``off``: the cap, throughout.
- ``steps``: ``min(cap, start + grow * (version // every))`` of the policy version a batch starts
  at -- a pure function, so a restarted actor computes the same limit with no state.
- ``clip_rate``: grows by ``grow`` (up to the cap) once more than ``length_clip_rate`` of the last
  ``length_window`` completions that ran under the current limit were cut by it ("length");
  the window then restarts, so the next decision sees only completions under the new limit. The
  limit is persisted atomically in ``run_dir/curriculum/actor<i>.json`` at every change and read
  back at start, so a restart keeps it (the window itself restarts empty).

Worked example: cap 16, start 8, grow 4.

- ``steps`` with every 10: versions 0-9 -> 8, 10-19 -> 12, 20 and on -> 16 (from 30 the
  formula gives 20 and more: capped).
- ``clip_rate`` 0.2 with window 10: under limit 8 the last 10 completions have 2 "length" -- not
  more than 20 %, no change; the 11th is cut too and the one it pushes out was not, so the last
  10 hold 3: the limit becomes 12 and the window empties. Completions still running under 8 when
  it changed are not counted under 12.
- a tier limited to 6 runs under min(6, curriculum limit): while the curriculum is above 6, that
  tier's completions do not feed it.
"""

from __future__ import annotations

import json
import os
from collections import deque
from numbers import Integral

from core.files import atomic_write, read_json

SCHEDULES = ("off", "steps", "clip_rate")


def prompt_limit(cfg, prompt, curriculum_limit: int | None = None) -> int:
    """The response-length limit of ``prompt`` (a ``Prompt``) under ``cfg`` (module docstring)."""
    cap = cfg.actor.max_new_tokens
    tier = cfg.task.tier_max_new_tokens.get(prompt.tier, cap)
    return min(cap, tier, cap if curriculum_limit is None else curriculum_limit)


def steps_limit(version: int, *, start: int, grow: int, every: int, cap: int) -> int:
    """The ``steps`` schedule's limit for a batch started at ``version`` (before any: version 0)."""
    return min(cap, start + grow * (max(version, 0) // every))


def state_path(run_dir: str, actor_id: str) -> str:
    """Where the ``clip_rate`` limit of ``actor_id`` survives a restart."""
    return os.path.join(run_dir, "curriculum", f"{actor_id}.json")


def _saved_limit(path: str) -> int | None:
    """The persisted limit, or None when there is none yet; a damaged record is a clear error."""
    rec = read_json(path)
    if rec is None:
        return None
    limit = rec.get("limit") if isinstance(rec, dict) else None
    if isinstance(limit, bool) or not isinstance(limit, Integral) or limit < 1:
        raise ValueError(f"{path}: `limit` = {limit!r} is not a positive integer (delete the file to restart "
                         f"the length curriculum from actor.length_start)")
    return int(limit)


class LengthCurriculum:
    """One actor's curriculum limit. ``limit(version)`` is the limit a batch started at that
    version runs under; ``observe`` feeds each finished completion (only ``clip_rate`` uses it)."""

    def __init__(self, actor_cfg, path: str | None = None):
        a = actor_cfg
        if a.length_schedule not in SCHEDULES:
            raise ValueError(f"actor.length_schedule = {a.length_schedule!r}: one of {', '.join(SCHEDULES)}")
        self.schedule, self.cap, self.path = a.length_schedule, a.max_new_tokens, path
        self.start, self.grow, self.every = min(a.length_start, self.cap), a.length_grow, a.length_every
        self.rate = a.length_clip_rate
        self.window: deque[bool] = deque(maxlen=a.length_window)
        saved = _saved_limit(path) if path and self.schedule == "clip_rate" else None
        # a resume may lower the cap: the saved limit never exceeds what the buffer now admits
        self.current = self.start if saved is None else min(self.cap, saved)

    def limit(self, version: int) -> int:
        if self.schedule == "off":
            return self.cap
        if self.schedule == "steps":
            return steps_limit(version, start=self.start, grow=self.grow, every=self.every, cap=self.cap)
        return self.current

    def observe(self, finish_reason: str, limit: int) -> bool:
        """One finished completion that ran under ``limit``; True when the limit grew."""
        if self.schedule != "clip_rate" or limit != self.current or self.current >= self.cap:
            return False  # another limit (a tier's, or the one before a change) says nothing of this one
        self.window.append(finish_reason == "length")
        full = len(self.window) == self.window.maxlen
        if not full or sum(self.window) <= self.rate * len(self.window):
            return False
        self.current = min(self.cap, self.current + self.grow)
        self.window.clear()
        self._persist()
        return True

    def _persist(self) -> None:
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            atomic_write(self.path, json.dumps({"limit": self.current}).encode())
