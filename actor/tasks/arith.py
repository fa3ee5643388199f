"""Built-in verifiable task: multi-digit addition, ``"<s>47+38="`` -> ``"85</s>"``, exact match. Operand pairs
are split into train and held-out by a hash, so held-out pairs are never seen in pre-training or RL. The tiny
base model's tokenizer is character-level: its capacity goes to arithmetic, not to merges.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from actor.tasks import Prompt, Task, held_out

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+-*=?: \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def build_tokenizer(chars: Sequence[str] = CHARS):
    """The character-level tokenizer over ``chars`` (more symbols go after these, whose ids stay put)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<s>|</s>|<pad>|<unk>|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


def tokenizer_files(model_max_length: int = 128, chars: Sequence[str] = CHARS) -> dict[str, bytes]:
    """The tokenizer's files (its special ids go into config.json: :func:`special_ids`)."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", "unk_token": "<unk>", "padding_side": "left", "model_max_length": model_max_length}
    return {"tokenizer.json": build_tokenizer(chars).to_str().encode(),
            "tokenizer_config.json": json.dumps(cfg, indent=2).encode()}


def special_ids() -> dict[str, int]:
    return {"pad_token_id": SPECIALS.index("<pad>"), "bos_token_id": SPECIALS.index("<s>"),
            "eos_token_id": SPECIALS.index("</s>")}


def tiny_base_model(task_cls, cfg, chars: Sequence[str] = CHARS) -> str:
    """Path of a character-level task's tiny base model, pre-trained on first use (model/basemodel.py)."""
    from model.basemodel import ensure_base_model, pretrain
    from model.tokenizer import Tokenizer

    ids = special_ids()
    task = task_cls(cfg.task, Tokenizer.build(build_tokenizer(chars), ids, {}, {}))
    files = tokenizer_files(cfg.model.max_position_embeddings, chars)
    build = lambda out: pretrain(cfg, task, files, ids, out)  # noqa: E731
    return ensure_base_model(cfg, build, task.pretrain_recipe(cfg.model))


class ArithTask(Task):
    name = "arith"
    chars = CHARS  # the symbols of its tiny base model's tokenizer

    def sample(self, rng: random.Random, split: str = "train") -> Prompt:
        hi = 10**self.cfg.digits - 1
        while True:
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            key = f"{a}+{b}"
            if held_out(key, self.cfg.eval_frac) == (split == "eval"):
                bos = [] if self.tok.bos_id is None else [self.tok.bos_id]
                return Prompt(key, tuple(bos + self.tok.encode(f"{key}=")), answer=str(a + b))

    def reward(self, prompt: Prompt, completion_ids) -> float:
        return 1.0 if self.completion_text(completion_ids) == prompt.answer else 0.0

    def pretrain_completion(self, prompt: Prompt, rng: random.Random, model_cfg) -> str:
        """The sum with probability ``pretrain_correct_frac``, else its digits backwards: a wrong habit."""
        return prompt.answer if rng.random() < model_cfg.pretrain_correct_frac else prompt.answer[::-1]

    def pretrain_recipe(self, model_cfg) -> dict:
        return {}

    @classmethod
    def base_model(cls, cfg) -> str:
        return tiny_base_model(cls, cfg, cls.chars)
