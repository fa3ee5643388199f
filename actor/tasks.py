"""Built-in verifiable task: multi-digit addition with an exact-match reward.

Prompt ``"<s>47+38="``, expected completion ``"85</s>"``. Reward 1.0 when the text before the
first EOS is exactly the sum, else 0.0. Operand pairs are split deterministically into a training
and a held-out evaluation split by a hash, so the held-out pairs are never seen in pre-training
or RL.

The tokenizer is character-level (a real ``tokenizers`` WordLevel model saved as
``tokenizer.json``), so the tiny model spends its capacity on arithmetic, not on merges.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+-*=?: \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
PAD, BOS, EOS = 0, 1, 2


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<s>|</s>|<pad>|<unk>|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


def tokenizer_files() -> dict[str, bytes]:
    """Files that make the tokenizer loadable by ``tokenizers`` and ``transformers``."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "padding_side": "left",
        "model_max_length": 128,
    }
    return {
        "tokenizer.json": build_tokenizer().to_str().encode(),
        "tokenizer_config.json": json.dumps(cfg, indent=2).encode(),
    }


def vocab_size() -> int:
    return len(SPECIALS) + len(CHARS)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def key(self) -> str:
        return f"{self.a}+{self.b}"


class ArithTask:
    name = "arith"

    def __init__(self, digits: int = 2, eval_frac: float = 0.1):
        self.digits = digits
        self.eval_frac = eval_frac
        self.tok = build_tokenizer()
        self._vocab = self.tok.get_vocab()

    def is_eval(self, p: Problem) -> bool:
        h = int.from_bytes(hashlib.blake2b(p.key.encode(), digest_size=4).digest(), "little")
        return (h % 10_000) < self.eval_frac * 10_000

    def _random_problem(self, rng: random.Random) -> Problem:
        hi = 10**self.digits - 1
        return Problem(rng.randint(0, hi), rng.randint(0, hi))

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        want_eval = split == "eval"
        while True:
            p = self._random_problem(rng)
            if self.is_eval(p) == want_eval:
                return p

    def eval_set(self, n: int, seed: int = 1234) -> list[Problem]:
        """A fixed held-out set: the same n problems for every evaluation of a run."""
        rng = random.Random(seed)
        return [self.sample(rng, "eval") for _ in range(n)]

    # ---- tokens ------------------------------------------------------------------------------

    def encode_prompt(self, p: Problem) -> list[int]:
        return [BOS] + [self._vocab[c] for c in p.prompt]

    def encode_text(self, text: str) -> list[int]:
        return [self._vocab[c] for c in text]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    # ---- reward -------------------------------------------------------------------------------

    def reward(self, p: Problem, completion_ids) -> float:
        """1.0 iff the text before the first EOS is exactly the sum; EOS must have been produced."""
        ids = [int(i) for i in completion_ids]
        if EOS not in ids:
            return 0.0
        return 1.0 if self.decode(ids[: ids.index(EOS)]) == p.answer else 0.0


def make_task(cfg_task) -> ArithTask:
    if cfg_task.name == "arith":
        return ArithTask(cfg_task.digits, cfg_task.eval_frac)
    raise ValueError(f"unknown task {cfg_task.name!r}")
