"""Response-length limits: a prompt's limit, and the length curriculum's limit over a run. ``steps`` is a
pure function of the batch's start version (a restart needs no state); ``clip_rate`` depends on what was
cut, so it persists its limit for a restarted actor.
"""

from __future__ import annotations

import json
import os
from collections import deque
from numbers import Integral

from core.files import atomic_write, read_json


def prompt_limit(cfg, prompt, curriculum_limit: int | None = None) -> int:
    cap = cfg.actor.max_new_tokens
    tier = cfg.task.tier_max_new_tokens.get(prompt.tier, cap)
    return min(cap, tier, cap if curriculum_limit is None else curriculum_limit)


def state_path(run_dir: str, actor_id: str) -> str:
    return os.path.join(run_dir, "curriculum", f"{actor_id}.json")


class LengthCurriculum:
    """One actor's curriculum: ``limit(version)`` of a batch started then; ``observe`` what finished."""

    def __init__(self, actor_cfg, path: str | None = None):
        a = actor_cfg  # length_schedule: "off", "steps" or "clip_rate" (checked by core/config.py)
        self.schedule, self.cap, self.path = a.length_schedule, a.max_new_tokens, path
        self.start, self.grow, self.every = min(a.length_start, self.cap), a.length_grow, a.length_every
        self.rate, self.window = a.length_clip_rate, deque(maxlen=a.length_window)  # window: cut or not, per completion
        saved = None
        if path and self.schedule == "clip_rate" and (rec := read_json(path)) is not None:
            saved = rec.get("limit") if isinstance(rec, dict) else None
            if isinstance(saved, bool) or not isinstance(saved, Integral) or saved < 1:
                raise ValueError(f"{path}: `limit` = {saved!r} is not a positive integer (delete the file to "
                                 "restart the length curriculum from actor.length_start)")
        self.current = self.start if saved is None else min(self.cap, int(saved))  # a resume may lower the cap

    def limit(self, version: int) -> int:
        if self.schedule == "off":
            return self.cap
        if self.schedule == "steps":
            return min(self.cap, self.start + self.grow * (max(version, 0) // self.every))
        return self.current

    def observe(self, finish_reason: str, limit: int) -> bool:
        """One finished completion that ran under ``limit``; True when the limit grew."""
        if self.schedule != "clip_rate" or limit != self.current or self.current >= self.cap:
            return False
        self.window.append(finish_reason == "length")
        if len(self.window) < self.window.maxlen or sum(self.window) <= self.rate * len(self.window):
            return False
        self.current = min(self.cap, self.current + self.grow)
        self.window.clear()
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            atomic_write(self.path, json.dumps({"limit": self.current}).encode())
        return True
