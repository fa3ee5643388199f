"""Procedural tasks of ``reasoning-gym``, scored by each dataset's own scorer in the reward pool. ``task.datasets``
are mixed uniformly per prompt (repeat a name to weight it); each split is its own procedural stream, an item eval
only if a hash of its question falls within ``task.eval_frac``. The payload names the item and the worker
regenerates it (a JSON round trip would turn tuple grids into lists); a question hash guards that it is the same.
"""

from __future__ import annotations

import difflib
import functools
import random

from actor.rewards import PooledTask
from actor.tasks import Prompt, held_out, stable_hash, tier_of

MAX_DRAWS = 10_000  # draws to find an item of the wanted split before giving up


def split_seed(name: str, split: str) -> int:
    return stable_hash(f"driftrl-gym/{name}/{split}")


def check_names(names: list[str]) -> list[str]:
    from reasoning_gym.factory import DATASETS

    if not names:
        raise ValueError('task.datasets is empty: name reasoning-gym datasets, e.g. task.datasets=["basic_arithmetic"]')
    for name in names:
        if name == "composite":
            raise ValueError("task.datasets: 'composite' needs its own config; list the datasets to mix instead")
        if name not in DATASETS:
            close = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.5)
            hint = (f"close matches: {', '.join(close)}" if close
                    else f"{len(DATASETS)} names in reasoning_gym.factory.DATASETS")
            raise ValueError(f"task.datasets: unknown reasoning-gym dataset {name!r}; {hint}")
    return list(names)


@functools.lru_cache(maxsize=64)
def dataset(name: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size)


@functools.lru_cache(maxsize=4096)
def entry(name: str, seed: int, size: int, index: int) -> dict:
    """Item ``index`` of a dataset (cached: a group's answers share it)."""
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

    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        name = rng.choice(self.names)
        seed = split_seed(name, split)
        for _ in range(MAX_DRAWS):
            index = rng.randrange(self.cfg.size)
            item = entry(name, seed, self.cfg.size, index)
            if held_out(item["question"], self.cfg.eval_frac, 8) == (split == "eval"):
                difficulty, tier = difficulty_of(item.get("metadata") or {})
                tier, answer = self.tier(difficulty, tier), item.get("answer")
                return Prompt(f"{name}-{split}-{index}", self.prompt_tokens(item["question"], tier), tier,
                              difficulty, "" if answer is None else str(answer))
        raise ValueError(f"reasoning-gym dataset {name!r}: no {split} item in {MAX_DRAWS} draws "
                         f"(task.size={self.cfg.size}, task.eval_frac={self.cfg.eval_frac})")

    def payload(self, prompt: Prompt, text: str) -> dict:
        name, split, index = prompt.id.rsplit("-", 2)
        seed = split_seed(name, split)
        question = entry(name, seed, self.cfg.size, int(index))["question"]
        return {"dataset": name, "seed": seed, "size": self.cfg.size, "index": int(index),
                "question_hash": stable_hash(question, 8), "text": text}


# the scorer, run in a reward-pool worker
def warmup() -> None:
    """Import reasoning-gym before the first answer's clock starts (~2 s)."""
    import reasoning_gym.utils  # the package with it  # noqa: F401


def score(payload: dict) -> float:
    from reasoning_gym.utils import extract_answer

    args = (payload["dataset"], payload["seed"], payload["size"], payload["index"])
    item = entry(*args)
    if stable_hash(item["question"], 8) != payload["question_hash"]:
        raise ValueError(f"reasoning-gym item {args} regenerated differently from the prompt: "
                         "the dataset is not deterministic in its seed")
    tagged = extract_answer(payload["text"])  # the last <answer> tag's text, else the whole completion
    return float(dataset(*args[:3]).score_answer(payload["text"].strip() if tagged is None else tagged, item))
