"""Response-length limits: the one rule for a prompt's limit, and the curriculum's limit over a run.

A prompt's limit is the smallest of ``actor.max_new_tokens``, its tier's
``task.tier_max_new_tokens`` and, in training, the curriculum's (``actor.length_schedule``):
``steps`` is a pure function of the batch's start version (a restart needs no state);
``clip_rate`` grows once more than ``length_clip_rate`` of the last ``length_window``
completions run under the current limit were cut by it, then restarts its window, and persists
the limit so a restarted actor keeps it. Completions under another limit do not feed it.
"""

from __future__ import annotations

import json
import os
from collections import deque
from numbers import Integral

from core.files import atomic_write, read_json

SCHEDULES = ("off", "steps", "clip_rate")


def prompt_limit(cfg, prompt, curriculum_limit: int | None = None) -> int:
    cap = cfg.actor.max_new_tokens
    tier = cfg.task.tier_max_new_tokens.get(prompt.tier, cap)
    return min(cap, tier, cap if curriculum_limit is None else curriculum_limit)


def steps_limit(version: int, *, start: int, grow: int, every: int, cap: int) -> int:
    return min(cap, start + grow * (max(version, 0) // every))


def state_path(run_dir: str, actor_id: str) -> str:
    return os.path.join(run_dir, "curriculum", f"{actor_id}.json")


def _saved_limit(path: str) -> int | None:
    rec = read_json(path)
    if rec is None:
        return None
    limit = rec.get("limit") if isinstance(rec, dict) else None
    if isinstance(limit, bool) or not isinstance(limit, Integral) or limit < 1:
        raise ValueError(f"{path}: `limit` = {limit!r} is not a positive integer (delete the file to restart "
                         f"the length curriculum from actor.length_start)")
    return int(limit)


class LengthCurriculum:
    """One actor's curriculum: ``limit(version)`` of a batch started then; ``observe`` what finished."""

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
            return False
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
