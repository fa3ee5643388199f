"""Procedural tasks of ``reasoning-gym``, scored by each dataset's own scorer in the reward pool.

``task.datasets`` names any of reasoning-gym's datasets (``reasoning_gym.factory.DATASETS``);
several names are a mix, drawn uniformly per prompt (repeat a name to weight it). Each is built
with ``reasoning_gym.create_dataset(name, seed=..., size=task.size)`` under a seed derived from
its name and the split, so the train and eval splits are different procedural streams; on top,
an item belongs to the eval split only if a hash of its question falls within
``task.eval_frac`` (as in :mod:`actor.tasks.arith`), so no eval question is ever trained on,
even where two seeds produce the same question.

Difficulty and tier come from the item's metadata where it says something: reasoning-gym
records the dataset's configured ranges (``metadata["difficulty"] = {"num_terms": (2, 6), ...}``)
next to the item's own values (``metadata["num_terms"] = 3``), so the difficulty is where the
item's values sit inside those ranges, averaged (0 = easiest, 1 = hardest) and the tier its
third; items whose metadata has no such pair are tier "default".

Answer extraction: reasoning-gym's scorers expect the final answer alone, and its prompts ask
models to write ``<answer>...</answer>``; the text inside the last such tag is scored
(``reasoning_gym.utils.extract_answer``), else the whole completion, stripped.

Scoring runs in the reward pool (``actor/rewards.py``). The payload names the item (dataset,
seed, size, index) rather than carrying it: the worker regenerates the entry -- reasoning-gym's
items are deterministic in (seed, index) -- so the scorer sees exactly the entry, metadata with
its tuples included (a JSON round trip turns ARC's tuple grids into lists, which its scorer
rejects); a hash of the question guards the regeneration.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import random

from actor.rewards import PooledTask
from actor.tasks import Prompt, tier_of

SPLITS = ("train", "eval")
MAX_DRAWS = 10_000  # draws to find an item of the wanted split before giving up


def _hash(text: str, size: int = 8) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=size).digest(), "little")


def split_seed(name: str, split: str) -> int:
    """The dataset seed of ``name``'s ``split``: stable across runs, different per split."""
    return _hash(f"driftrl-gym/{name}/{split}", 4)


def check_names(names: list[str]) -> list[str]:
    """``names`` if every one is a reasoning-gym dataset; a clear error with close matches else."""
    from reasoning_gym.factory import DATASETS

    if not names:
        raise ValueError('task.datasets is empty: name reasoning-gym datasets, e.g. task.datasets=["basic_arithmetic"]')
    for name in names:
        if name == "composite":
            raise ValueError("task.datasets: 'composite' needs its own config; list the datasets to mix instead")
        if name not in DATASETS:
            close = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.5)
            hint = f"close matches: {', '.join(close)}" if close else f"{len(DATASETS)} names in reasoning_gym.factory.DATASETS"
            raise ValueError(f"task.datasets: unknown reasoning-gym dataset {name!r}; {hint}")
    return list(names)


@functools.lru_cache(maxsize=64)
def dataset(name: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size)


@functools.lru_cache(maxsize=4096)
def entry(name: str, seed: int, size: int, index: int) -> dict:
    """Item ``index`` of a dataset (deterministic; cached: a group's answers share it)."""
    return dataset(name, seed, size)[index]


def difficulty_of(metadata: dict) -> tuple[float, str]:
    """``(difficulty, tier)`` from where the item's parameters sit in the configured ranges."""
    ranges = metadata.get("difficulty")
    spots = []
    for key, span in (ranges.items() if isinstance(ranges, dict) else ()):
        value = metadata.get(key)
        if (isinstance(value, (int, float)) and isinstance(span, (tuple, list)) and len(span) == 2
                and all(isinstance(x, (int, float)) for x in span) and span[1] > span[0]):
            spots.append(min(max((value - span[0]) / (span[1] - span[0]), 0.0), 1.0))
    if not spots:
        return 0.0, "default"
    d = round(sum(spots) / len(spots), 2)
    return d, tier_of(d)


class GymTask(PooledTask):
    name = "gym"
    scorer = "actor.tasks.gym:score"

    def __init__(self, cfg_task, tokenizer):
        super().__init__(cfg_task, tokenizer)
        self.names = check_names(cfg_task.datasets)
        tokenizer.wants_chat(cfg_task.chat_template)  # "on" without a template fails now, not mid-run

    def _is_eval(self, question: str) -> bool:
        return (_hash(question) % 10_000) < self.cfg.eval_frac * 10_000

    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        name = rng.choice(self.names)
        seed = split_seed(name, split)
        for _ in range(MAX_DRAWS):
            index = rng.randrange(self.cfg.size)
            item = entry(name, seed, self.cfg.size, index)
            if self._is_eval(item["question"]) == (split == "eval"):
                return self._prompt(name, split, index, item)
        raise ValueError(f"reasoning-gym dataset {name!r}: no {split} item in {MAX_DRAWS} draws "
                         f"(task.size={self.cfg.size}, task.eval_frac={self.cfg.eval_frac})")

    def _prompt(self, name: str, split: str, index: int, item: dict) -> Prompt:
        difficulty, tier = difficulty_of(item.get("metadata") or {})
        tier = self.tier(difficulty, tier)
        answer = item.get("answer")
        return Prompt(f"{name}-{split}-{index}", self.prompt_tokens(item["question"], tier), tier, difficulty,
                      "" if answer is None else str(answer))

    def payload(self, prompt: Prompt, text: str) -> dict:
        name, split, index = prompt.id.rsplit("-", 2)
        seed = split_seed(name, split)
        question = entry(name, seed, self.cfg.size, int(index))["question"]
        return {"dataset": name, "seed": seed, "size": self.cfg.size, "index": int(index),
                "question_hash": _hash(question), "text": text}


# ---- the scorer (runs in a reward-pool worker) ------------------------------------------------

def warmup() -> None:
    """Import reasoning-gym before the first answer's clock starts (~2 s)."""
    import reasoning_gym  # noqa: F401
    import reasoning_gym.utils  # noqa: F401


def extract(text: str) -> str:
    """The final answer: inside the last ``<answer>`` tag, else the whole text."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(text)
    return text.strip() if tagged is None else tagged


def score(payload: dict) -> float:
    """reasoning-gym's own score of the completion ``payload["text"]`` for the named item."""
    args = (payload["dataset"], payload["seed"], payload["size"], payload["index"])
    item = entry(*args)
    if _hash(item["question"]) != payload["question_hash"]:
        raise ValueError(f"reasoning-gym item {args} regenerated differently from the prompt: "
                         "the dataset is not deterministic in its seed")
    return float(dataset(*args[:3]).score_answer(extract(payload["text"]), item))
