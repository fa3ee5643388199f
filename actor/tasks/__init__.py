"""The ``Task`` seam: where prompts come from and how a completion is scored. A task tokenises
through the model's own tokenizer (``model.tokenizer``), so special ids are the checkpoint's.
"""

from __future__ import annotations

import abc
import hashlib
import random
from dataclasses import dataclass

from core.registry import resolve


@dataclass(frozen=True)
class Prompt:
    id: str  # stable across runs: group ids and eval sets are built from it
    tokens: tuple[int, ...]
    tier: str = "default"
    difficulty: float = 0.0
    answer: str = ""  # the reference answer, where the task has one (reward, pre-training text)


class Task(abc.ABC):
    """Prompts (train/eval splits) and a verifiable reward, tokenised by ``tokenizer``."""

    name = ""

    def __init__(self, cfg_task, tokenizer):
        self.cfg, self.tok = cfg_task, tokenizer

    @abc.abstractmethod
    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        """One prompt of ``split`` ("train" or "eval"; the two never overlap)."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, completion_ids) -> float:
        """The verifiable reward of one completion (token ids as sampled, EOS included)."""

    @classmethod
    def base_model(cls, cfg) -> str:
        """Path of this task's built-in tiny base model, for runs that set no ``model.path``. A task
        with one writes its corpus for ``model/basemodel.py``: ``pretrain_completion(prompt, rng,
        model_cfg) -> str`` and ``pretrain_recipe(model_cfg) -> dict`` (its cache key); see arith."""
        raise ValueError(f"task {cls.name!r} has no built-in base model: set model.path to a checkpoint directory")

    def rewards(self, items: list[tuple[Prompt, list[int]]]) -> list[float]:
        """Rewards of many ``(prompt, completion_ids)``, in order (pooled tasks: ``actor/rewards.py``)."""
        return [self.reward(p, ids) for p, ids in items]

    def metrics(self) -> dict[str, float]:
        """Cumulative counters the worker reports (e.g. ``reward/timeouts``, ``reward/errors``)."""
        return {}

    def close(self) -> None:
        """Release what the task holds (a reward pool)."""

    def episode_metrics(self, items: list[tuple[Prompt, list[int]]]) -> dict[str, float]:
        """A tool task's own rates over ``(prompt, completion_ids)`` (e.g. correct tool use: actor/tasks/calc.py)."""
        return {}

    def eval_set(self, n: int, seed: int = 1234) -> list[Prompt]:
        """The same ``n`` held-out prompts for every evaluation of a run."""
        rng = random.Random(seed)
        return [self.sample(rng, "eval") for _ in range(n)]

    def completion_text(self, completion_ids) -> str | None:
        """Text before the first EOS, or None when no EOS was sampled (a truncated answer)."""
        ids = [int(i) for i in completion_ids]
        end = next((i for i, t in enumerate(ids) if t in self.tok.eos_ids), None)
        return None if end is None else self.tok.decode(ids[:end])

    def tier(self, difficulty: float, by_level: str) -> str:
        """``by_level`` (the task's own tier) unless ``task.difficulty_tiers`` (pipeline.py's tiers by
        measured pass rate, keyed by ``str(Prompt.difficulty)``) assigns this difficulty one."""
        return self.cfg.difficulty_tiers.get(str(difficulty), by_level)

    def prompt_tokens(self, text: str, tier: str = "default") -> tuple[int, ...]:
        """Prompt ids of a question ``text`` (+ ``task.instruction``), with ``tier``'s system prompt
        (else ``task.system_prompt["default"]``), through the chat template if it is wanted."""
        if self.cfg.instruction:
            text = f"{text}\n\n{self.cfg.instruction}"
        system = self.cfg.system_prompt.get(tier, self.cfg.system_prompt.get("default", ""))
        return tuple(self.tok.prompt(text, self.tok.wants_chat(self.cfg.chat_template), system, self.cfg.tools.schema))


def stable_hash(text: str, size: int = 4) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=size).digest(), "little")


def held_out(key: str, frac: float, digest_size: int = 4) -> bool:
    return stable_hash(key, digest_size) % 10_000 < frac * 10_000


def tier_of(difficulty: float) -> str:
    return "low" if difficulty < 1 / 3 else "medium" if difficulty < 2 / 3 else "high"


TASKS = {"arith": "actor.tasks.arith:ArithTask", "scratch": "actor.tasks.scratch:ScratchTask",
         "gym": "actor.tasks.gym:GymTask", "math": "actor.tasks.mathfile:MathTask", "calc": "actor.tasks.calc:CalcTask"}


def task_class(name: str) -> type[Task]:
    return resolve(TASKS, name, "task")


def make_task(cfg_task, tokenizer) -> Task:
    return task_class(cfg_task.name)(cfg_task, tokenizer)
