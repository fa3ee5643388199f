"""Built-in reasoning task: long division, where writing the working out pays.

Prompt ``"<s>7653/3="``: a dividend that the divisor divides exactly, the quotient ``d`` digits
long (``d`` drawn from ``task.min_digits..task.digits``; ``Prompt.difficulty`` is ``d``'s place in
that range, 0..1). A completion either answers directly, ``"2551</s>"``, or first writes the
working -- ``r`` and then the running remainder after each digit of the dividend, as in long
division on paper -- and then the quotient after the last ``:``::

    r1100:2551</s>        (7 = 2*3+1, 16 = 5*3+1, 15 = 5*3+0, 3 = 1*3+0)

The reward is 1.0 iff EOS was produced and the text after the last ``:`` (the whole text when
there is none) is exactly the quotient; the working is never graded, so RL has to discover that
writing it pays.

Why this task: each quotient digit depends on the remainder left by *every* earlier digit. A
tiny model answering directly has to carry that chain inside one forward pass per digit, and its
accuracy falls with ``d``; with the remainders written down, every digit it writes depends only on
the token before it, one dividend digit and the divisor, at offsets that do not change along the
answer -- the kind of step a small transformer learns reliably. So a longer written chain of
thought measurably raises accuracy, which is what a reasoning recipe elicits and later shapes by
length. Divisors are 3, 6, 7 and 9 because a remainder modulo 2, 4, 5 or 8 can be read off the
last few digits, which needs no working.

The base model (``model/basemodel.py``) is pre-trained to answer mostly without working: a
``pretrain_worked_frac`` share of its corpus is worked, the rest direct answers, correct with
probability ``pretrain_correct_frac`` and otherwise divided digit by digit with the remainders
dropped; a ``pretrain_redundant_frac`` share of the worked ones is written out twice, as a check
(``r1100:2551r1100:2551``). Problems are split into train and held-out by a hash, as in :mod:`actor.tasks.arith`,
whose character-level tokenizer this task extends with ``/``.
"""

from __future__ import annotations

import hashlib
import random

from actor.tasks import Prompt, Task, tier_of
from actor.tasks.arith import CHARS as ARITH_CHARS, build_tokenizer, special_ids, tokenizer_files

CHARS = [*ARITH_CHARS, "/"]
DIVISORS = (3, 6, 7, 9)
WORK_MARK = "r"  # a worked completion starts with it: "think first" is one token to choose
ANSWER_SEP = ":"  # the final answer follows the last one
FORMAT_VERSION = 1  # bump when the corpus format changes: it keys the cached base model


def remainders(a: int, k: int) -> str:
    """The running remainder of ``a / k`` after each digit of ``a``, one digit each."""
    r, out = 0, []
    for c in str(a):
        r = (10 * r + int(c)) % k
        out.append(str(r))
    return "".join(out)


def worked_text(a: int, k: int) -> str:
    """The worked completion: the marker, the remainders, then the quotient."""
    return f"{WORK_MARK}{remainders(a, k)}{ANSWER_SEP}{a // k}"


def checked_text(a: int, k: int) -> str:
    """The worked completion written twice, the second time as a check: just as correct (the
    answer is what follows the last ``:``) and about twice as long -- the redundancy a
    self-distillation that keeps the shortest correct completion removes."""
    return worked_text(a, k) * 2


def digitwise_quotient(a: int, k: int) -> str:
    """Every digit divided alone, remainders dropped: the direct habit's mistake."""
    return str(int("".join(str(int(c) // k) for c in str(a))))


def final_answer(text: str) -> str:
    """The text after the last answer separator (all of it for a direct answer)."""
    return text.rsplit(ANSWER_SEP, 1)[-1]


def is_worked(text: str) -> bool:
    return ANSWER_SEP in text


def operands(prompt: Prompt) -> tuple[int, int]:
    a, k = prompt.id.split("/")
    return int(a), int(k)


class ScratchTask(Task):
    name = "scratch"

    def __init__(self, cfg_task, tokenizer):
        if cfg_task.min_digits > cfg_task.digits:
            raise ValueError(f"task.min_digits={cfg_task.min_digits} exceeds task.digits={cfg_task.digits}")
        super().__init__(cfg_task, tokenizer)

    def _is_eval(self, key: str) -> bool:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
        return (h % 10_000) < self.cfg.eval_frac * 10_000

    def difficulty(self, d: int) -> float:
        """Where ``d`` quotient digits sit in ``min_digits..digits``: 0 = easiest, 1 = hardest
        (the scale every task's ``Prompt.difficulty`` and tier use)."""
        lo, hi = self.cfg.min_digits, self.cfg.digits
        return 0.0 if hi == lo else (d - lo) / (hi - lo)

    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        d = rng.randint(self.cfg.min_digits, self.cfg.digits)
        while True:
            q, k = rng.randint(10 ** (d - 1), 10**d - 1), rng.choice(DIVISORS)
            key = f"{q * k}/{k}"
            if self._is_eval(key) == (split == "eval"):
                level = self.difficulty(d)
                tier = self.tier(level, tier_of(level))
                return Prompt(key, self.prompt_tokens(f"{key}=", tier), tier, level, answer=str(q))

    def reward(self, prompt: Prompt, completion_ids) -> float:
        """1.0 iff EOS was produced and the final answer is exactly the quotient; working is free."""
        text = self.completion_text(completion_ids)
        return 1.0 if text is not None and final_answer(text) == prompt.answer else 0.0

    def pretrain_completion(self, prompt: Prompt, rng: random.Random, model_cfg) -> str:
        """Worked with probability ``pretrain_worked_frac`` (and then, with probability
        ``pretrain_redundant_frac``, written out twice: :func:`checked_text`); else a direct
        answer, correct with probability ``pretrain_correct_frac``, otherwise divided digit by digit."""
        a, k = operands(prompt)
        if rng.random() < model_cfg.pretrain_worked_frac:
            return checked_text(a, k) if rng.random() < model_cfg.pretrain_redundant_frac else worked_text(a, k)
        return prompt.answer if rng.random() < model_cfg.pretrain_correct_frac else digitwise_quotient(a, k)

    def pretrain_recipe(self, model_cfg) -> dict:
        """What shapes this corpus beyond the shared fields: the difficulty range, the format
        and the worked share (and the redundant share, when there is one)."""
        recipe = {"min_digits": self.cfg.min_digits, "format": FORMAT_VERSION, "worked": model_cfg.pretrain_worked_frac}
        if model_cfg.pretrain_redundant_frac:  # only when set: earlier models' keys stay valid
            recipe["redundant"] = model_cfg.pretrain_redundant_frac
        return recipe

    @classmethod
    def base_model(cls, cfg) -> str:
        """Path of this task's tiny base model, pre-trained on first use (``model/basemodel.py``)."""
        from model.basemodel import ensure_base_model, pretrain
        from model.tokenizer import Tokenizer

        ids = special_ids()
        task = cls(cfg.task, Tokenizer.build(build_tokenizer(CHARS), ids, {}, {}))
        files = tokenizer_files(cfg.model.max_position_embeddings, CHARS)
        return ensure_base_model(cfg, lambda out: pretrain(cfg, task, files, ids, out),
                                 task.pretrain_recipe(cfg.model))
