"""Math problems from a JSONL or parquet file (rows: :class:`Row`, checked on load), scored by ``math-verify``
in the reward pool. math-verify's own ``signal.alarm`` bounds each phase at a third of the per-answer budget,
so a slow expression usually scores 0 inside it and the pool's kill stays the backstop.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re

import msgspec

from actor.rewards import PooledTask
from actor.tasks import Prompt, held_out, tier_of


class Row(msgspec.Struct):
    prompt: str
    answer: str | int | float
    id: str | int | None = None
    level: int | float | str | None = None
    difficulty: int | float | None = None


def _problem(raw, where: str) -> dict:
    try:
        row = msgspec.convert(raw, Row)
    except msgspec.ValidationError as e:
        raise ValueError(f"{where}: {str(e).replace('`$.', 'field `')}") from None
    answer, level = str(row.answer).strip(), row.level
    for name, value in (("prompt", row.prompt.strip()), ("answer", answer)):
        if not value:
            raise ValueError(f"{where}: field `{name}` is empty")
    if isinstance(level, str):  # MATH's "Level 3"
        m = re.fullmatch(r"\s*(?:level\s*)?(-?\d+(?:\.\d+)?)\s*", level, flags=re.IGNORECASE)
        if m is None:
            raise ValueError(f"{where}: field `level` = {level!r} is not a number or 'Level N'")
        level = m.group(1)
    difficulty = row.difficulty if row.difficulty is not None else level
    pid = str(row.id) if row.id is not None else hashlib.blake2b(row.prompt.encode(), digest_size=8).hexdigest()
    return {"id": pid, "prompt": row.prompt, "answer": answer,
            "difficulty": None if difficulty is None else float(difficulty)}


def _rows(path: str):
    """``(row, where)`` for every row of a parquet or JSONL file."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path} is parquet, which needs pyarrow: pip install pyarrow (or the extra: "
                             "pip install 'driftrl[tasks]'), or convert the file to JSONL") from None
        yield from ((raw, f"{path} row {n}") for n, raw in enumerate(pq.read_table(path).to_pylist(), 1))
    else:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line), f"{path} line {n}"
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path} line {n}: not JSON ({e})") from None


def load_problems(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"task file {path!r} does not exist")
    if not path.endswith((".parquet", ".jsonl", ".json", ".ndjson")):
        raise ValueError(f"task file {path!r}: expected .jsonl or .parquet")
    problems = [_problem(raw, where) for raw, where in _rows(path)]
    if not problems:
        raise ValueError(f"task file {path!r} has no rows")
    return problems


class MathTask(PooledTask):
    name = "math"
    scorer = "actor.tasks.mathfile:score"

    def __init__(self, cfg_task, tokenizer):
        super().__init__(cfg_task, tokenizer)
        if not cfg_task.path:
            raise ValueError("task.path is empty: set it to a JSONL or parquet file with `prompt` and `answer`")
        tokenizer.wants_chat(cfg_task.chat_template)  # "on" without a template fails now, not mid-run
        self.splits = self._split(load_problems(cfg_task.path),
                                  load_problems(cfg_task.eval_path) if cfg_task.eval_path else None)
        known = [p["difficulty"] for rows in self.splits.values() for p in rows if p["difficulty"] is not None]
        self.span = (min(known), max(known)) if known else (0.0, 0.0)
        self._prompts: dict[tuple[str, str], Prompt] = {}

    def _split(self, rows: list[dict], eval_rows: list[dict] | None) -> dict[str, list[dict]]:
        if eval_rows is None:
            eval_rows = [p for p in rows if held_out(p["id"], self.cfg.eval_frac)]
            rows = [p for p in rows if not held_out(p["id"], self.cfg.eval_frac)]
        for split, part in (("train", rows), ("eval", eval_rows)):
            if not part:
                raise ValueError(f"task.path {self.cfg.path!r}: no rows left for the {split} split "
                                 f"({len(rows) + len(eval_rows)} rows, task.eval_frac={self.cfg.eval_frac}); "
                                 "add rows or set task.eval_path")
        return {"train": rows, "eval": eval_rows}

    def _tier(self, difficulty: float | None) -> str:
        lo, hi = self.span
        return "default" if difficulty is None or hi <= lo else tier_of((difficulty - lo) / (hi - lo))

    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        row = rng.choice(self.splits[split])
        key = (split, row["id"])
        if key not in self._prompts:  # tokenised once, on first use: files can be large
            tier = self.tier(row["difficulty"] or 0.0, self._tier(row["difficulty"]))
            self._prompts[key] = Prompt(row["id"], self.prompt_tokens(row["prompt"], tier), tier,
                                        row["difficulty"] or 0.0, row["answer"])
        return self._prompts[key]

    def payload(self, prompt: Prompt, text: str) -> dict:
        return {"text": text, "answer": prompt.answer, "budget_s": self.cfg.reward_timeout_s}


# the scorer, run in a reward-pool worker
@functools.lru_cache(maxsize=4096)
def _gold(answer: str, alarm_s: int):
    from math_verify import parse

    return parse(f"${answer}$", parsing_timeout=alarm_s) or parse(answer, parsing_timeout=alarm_s)


def score(payload: dict) -> float:
    from math_verify import parse, verify

    alarm_s = max(1, int(float(payload.get("budget_s", 10.0)) / 3))  # a third of the answer's budget
    gold = _gold(str(payload["answer"]), alarm_s)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {payload['answer']!r}")
    pred = parse(payload["text"], parsing_timeout=alarm_s)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=alarm_s) else 0.0


def warmup() -> None:
    """Import math-verify (sympy, ~1-2 s) and run one check before the first answer's clock starts."""
    score({"text": "\\boxed{\\frac{1}{2}}", "answer": "0.5"})
