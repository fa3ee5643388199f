"""Built-in reasoning task: long division, where writing the working out pays. ``"<s>7653/3="`` is answered
directly, ``"2551</s>"``, or after ``r`` and the running remainder after each dividend digit, ``r1100:2551</s>``;
only the text after the last ``:`` is graded. Each quotient digit depends on every earlier remainder, which a tiny
model answering directly must carry in one forward pass, so written working measurably raises accuracy. Divisors
3, 6, 7, 9: a remainder modulo 2, 4, 5 or 8 can be read off the last digits, needing no working.
"""

from __future__ import annotations

import random

from actor.tasks import Prompt, Task, held_out, tier_of
from actor.tasks.arith import CHARS as ARITH_CHARS, tiny_base_model

CHARS = [*ARITH_CHARS, "/"]
DIVISORS = (3, 6, 7, 9)
WORK_MARK = "r"  # a worked completion starts with it: "think first" is one token to choose
ANSWER_SEP = ":"  # the final answer follows the last one
FORMAT_VERSION = 1  # bump when the corpus format changes: it keys the cached base model


def remainders(a: int, k: int) -> str:
    r, out = 0, []
    for c in str(a):
        r = (10 * r + int(c)) % k
        out.append(str(r))
    return "".join(out)


def worked_text(a: int, k: int) -> str:
    return f"{WORK_MARK}{remainders(a, k)}{ANSWER_SEP}{a // k}"


def checked_text(a: int, k: int) -> str:
    """The worked completion twice, as a check: as correct, twice as long (what distillation removes)."""
    return worked_text(a, k) * 2


def digitwise_quotient(a: int, k: int) -> str:
    """Every digit divided alone, remainders dropped: the direct habit's mistake."""
    return str(int("".join(str(int(c) // k) for c in str(a))))


def final_answer(text: str) -> str:
    return text.rsplit(ANSWER_SEP, 1)[-1]


def operands(prompt: Prompt) -> tuple[int, int]:
    a, k = prompt.id.split("/")
    return int(a), int(k)


class ScratchTask(Task):
    name = "scratch"

    def __init__(self, cfg_task, tokenizer):
        if cfg_task.min_digits > cfg_task.digits:
            raise ValueError(f"task.min_digits={cfg_task.min_digits} exceeds task.digits={cfg_task.digits}")
        super().__init__(cfg_task, tokenizer)

    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        lo, hi = self.cfg.min_digits, self.cfg.digits
        d = rng.randint(lo, hi)
        level = 0.0 if hi == lo else (d - lo) / (hi - lo)  # d quotient digits: 0 = easiest, 1 = hardest
        while True:
            q, k = rng.randint(10 ** (d - 1), 10**d - 1), rng.choice(DIVISORS)
            key = f"{q * k}/{k}"
            if held_out(key, self.cfg.eval_frac) == (split == "eval"):
                tier = self.tier(level, tier_of(level))
                return Prompt(key, self.prompt_tokens(f"{key}=", tier), tier, level, answer=str(q))

    def reward(self, prompt: Prompt, completion_ids) -> float:
        text = self.completion_text(completion_ids)
        return 1.0 if text is not None and final_answer(text) == prompt.answer else 0.0

    def pretrain_completion(self, prompt: Prompt, rng: random.Random, model_cfg) -> str:
        """Worked with probability ``pretrain_worked_frac`` (twice with ``pretrain_redundant_frac``),
        else direct: correct with ``pretrain_correct_frac``, otherwise divided digit by digit."""
        a, k = operands(prompt)
        if rng.random() < model_cfg.pretrain_worked_frac:
            return checked_text(a, k) if rng.random() < model_cfg.pretrain_redundant_frac else worked_text(a, k)
        return prompt.answer if rng.random() < model_cfg.pretrain_correct_frac else digitwise_quotient(a, k)

    def pretrain_recipe(self, model_cfg) -> dict:
        redundant = model_cfg.pretrain_redundant_frac  # in the key only when set: earlier models' keys stay valid
        return {"min_digits": self.cfg.min_digits, "format": FORMAT_VERSION, "worked": model_cfg.pretrain_worked_frac,
                **({"redundant": redundant} if redundant else {})}

    @classmethod
    def base_model(cls, cfg) -> str:
        return tiny_base_model(cls, cfg, CHARS)
