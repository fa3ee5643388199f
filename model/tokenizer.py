"""A model directory's own tokenizer and its special token ids.

Tasks tokenise through this, and engines stop on its EOS ids, so special ids come from the
checkpoint, never from module constants. Where each id is looked up, first hit wins:

    bos   config.json ``bos_token_id`` · tokenizer_config.json ``bos_token`` (by name)
    eos   generation_config.json ``eos_token_id`` · config.json ``eos_token_id`` (int or list) ·
          tokenizer_config.json ``eos_token``
    pad   config.json ``pad_token_id`` · tokenizer_config.json ``pad_token`` · the first EOS
          (padding is masked everywhere, so any in-vocabulary id is correct)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


def _read(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # AddedToken dicts too


@dataclass(frozen=True)
class Tokenizer:
    tok: object  # tokenizers.Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        return cls.build(HFTokenizer.from_file(file), _read(os.path.join(path, "config.json")),
                         _read(os.path.join(path, "generation_config.json")),
                         _read(os.path.join(path, "tokenizer_config.json")))

    @classmethod
    def build(cls, tok, config: dict, generation: dict, tok_config: dict) -> "Tokenizer":
        def by_name(key):
            name = _token_name(tok_config.get(key))
            return tok.token_to_id(name) if name else None

        eos = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id")) or _ids(by_name("eos_token"))
        if not eos:
            raise ValueError("no EOS id: set eos_token_id in config.json or generation_config.json")
        bos = config.get("bos_token_id", by_name("bos_token"))
        pad = config.get("pad_token_id")
        pad = pad if pad is not None else by_name("pad_token")
        return cls(tok, bos, eos, eos[0] if pad is None else int(pad))
