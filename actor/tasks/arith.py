"""Built-in verifiable task: multi-digit addition with an exact-match reward.

Prompt ``"<s>47+38="``, expected completion ``"85</s>"``. Reward 1.0 when the text before the
first EOS is exactly the sum, else 0.0. Operand pairs are split deterministically into a training
and a held-out evaluation split by a hash, so the held-out pairs are never seen in pre-training
or RL.

The tiny base model's tokenizer is character-level (a real ``tokenizers`` WordLevel model saved
as ``tokenizer.json``, :func:`tokenizer_files`), so the model spends its capacity on arithmetic,
not on merges. At run time the task reads whatever tokenizer the model directory has.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence

from actor.tasks import Prompt, Task

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+-*=?: \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def build_tokenizer(chars: Sequence[str] = CHARS):
    """The character-level tokenizer over ``chars`` (a task with more symbols appends them, so
    the ids of these stay put)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<s>|</s>|<pad>|<unk>|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


def tokenizer_files(model_max_length: int = 128, chars: Sequence[str] = CHARS) -> dict[str, bytes]:
    """Files that make the tokenizer loadable by ``tokenizers`` and ``transformers``; the special
    ids themselves go into the model's config.json (:func:`special_ids`)."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "padding_side": "left",
        "model_max_length": model_max_length,
    }
    return {
        "tokenizer.json": build_tokenizer(chars).to_str().encode(),
        "tokenizer_config.json": json.dumps(cfg, indent=2).encode(),
    }


def special_ids() -> dict[str, int]:
    return {"pad_token_id": SPECIALS.index("<pad>"), "bos_token_id": SPECIALS.index("<s>"),
            "eos_token_id": SPECIALS.index("</s>")}


def vocab_size() -> int:
    return len(SPECIALS) + len(CHARS)


class ArithTask(Task):
    name = "arith"

    def _is_eval(self, key: str) -> bool:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
        return (h % 10_000) < self.cfg.eval_frac * 10_000

    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        hi = 10**self.cfg.digits - 1
        while True:
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            key = f"{a}+{b}"
            if self._is_eval(key) == (split == "eval"):
                bos = [] if self.tok.bos_id is None else [self.tok.bos_id]
                return Prompt(key, tuple(bos + self.tok.encode(f"{key}=")), answer=str(a + b))

    def reward(self, prompt: Prompt, completion_ids) -> float:
        """1.0 iff the text before the first EOS is exactly the sum; EOS must have been produced."""
        return 1.0 if self.completion_text(completion_ids) == prompt.answer else 0.0

    def pretrain_completion(self, prompt: Prompt, rng: random.Random, model_cfg) -> str:
        """Pre-training text: the sum with probability ``pretrain_correct_frac``, else its digits
        backwards -- a wrong habit that leaves the arithmetic latent for RL to elicit."""
        return prompt.answer if rng.random() < model_cfg.pretrain_correct_frac else prompt.answer[::-1]

    def pretrain_recipe(self, model_cfg) -> dict:
        """Fields beyond the shared ones that shape the corpus: none."""
        return {}

    @classmethod
    def base_model(cls, cfg) -> str:
        """Path of this task's tiny base model, pre-trained on first use (``model/basemodel.py``)."""
        from model.basemodel import ensure_base_model, pretrain
        from model.tokenizer import Tokenizer

        ids = special_ids()
        task = cls(cfg.task, Tokenizer.build(build_tokenizer(), ids, {}, {}))
        files = tokenizer_files(cfg.model.max_position_embeddings)
        return ensure_base_model(cfg, lambda out: pretrain(cfg, task, files, ids, out),
                                 task.pretrain_recipe(cfg.model))
