"""A model directory's own tokenizer and special token ids, first hit winning: bos -- config.json,
tokenizer_config.json; eos -- generation_config.json, config.json, tokenizer_config.json; pad -- config.json,
tokenizer_config.json, the first EOS (padding is masked: any id will do). Chat templates render as transformers'
``apply_chat_template`` does, in jinja2's immutable sandbox: a checkpoint's template is untrusted code."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2.ext  # >= 3.1.6 (pyproject): older versions have known sandbox escapes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read(*path: str) -> dict:
    return json.loads(Path(*path).read_text()) if Path(*path).exists() else {}


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # AddedToken dicts too


def read_chat_template(path: str, tok_config: dict) -> str | None:
    """``chat_template.jinja``, else tokenizer_config.json's (its "default" of a list); None if neither."""
    if (file := Path(path, CHAT_TEMPLATE_FILE)).exists():
        return file.read_text(encoding="utf-8")
    value = tok_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if "default" not in named:
        raise ValueError(f"{path}/tokenizer_config.json: chat_template lists {sorted(map(str, named))} "
                         "but no template named 'default'")
    return named["default"]


@dataclass(frozen=True)
class Tokenizer:
    tok: object  # tokenizers.Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int
    chat_template: str | None = None  # jinja source; None: the checkpoint has none
    template_tokens: tuple[tuple[str, str], ...] = ()  # (bos_token, "<s>") etc.: template variables

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list | None = None) -> list[int]:
        """Token ids of ``messages`` (and ``tools``' schemas) as transformers' ``apply_chat_template`` gives them."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja, no chat_template "
                             "in tokenizer_config.json)")
        text = _compile(self.chat_template).render(
            messages=messages, tools=tools or None, documents=None, add_generation_prompt=add_generation_prompt,
            **dict(self.template_tokens))
        return self.encode(text)

    def wants_chat(self, mode: str) -> bool:
        """Whether prompts go through the chat template under task.chat_template = ``mode``."""
        if mode == "on" and self.chat_template is None:
            raise ValueError("task.chat_template = 'on' but the model's tokenizer has no chat template "
                             f"(no {CHAT_TEMPLATE_FILE}, no chat_template in tokenizer_config.json)")
        return mode == "on" or (mode == "auto" and self.chat_template is not None)

    def prompt(self, text: str, chat: bool, system: str = "", tools: list | None = None) -> list[int]:
        """Prompt ids of a user's ``text``: through the chat template (``system`` as its system
        message, ``tools`` in its tools block), else BOS, ``system`` and ``text`` as plain text."""
        if chat:
            system_msg = [{"role": "system", "content": system}] if system else []
            return self.apply_chat([*system_msg, {"role": "user", "content": text}], tools=tools)
        return ([] if self.bos_id is None else [self.bos_id]) + self.encode(system + text)

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok_config = _read(path, "tokenizer_config.json")
        return cls.build(HFTokenizer.from_file(file), _read(path, "config.json"), _read(path, "generation_config.json"),
                         tok_config, read_chat_template(path, tok_config))

    @classmethod
    def build(cls, tok, config: dict, generation: dict, tok_config: dict,
              chat_template: str | None = None) -> "Tokenizer":
        def by_name(key):
            name = _token_name(tok_config.get(key))
            return tok.token_to_id(name) if name else None

        eos = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id")) or _ids(by_name("eos_token"))
        if not eos:
            raise ValueError("no EOS id: set eos_token_id in config.json or generation_config.json")
        bos = config.get("bos_token_id", by_name("bos_token"))
        pad = config.get("pad_token_id")
        pad = pad if pad is not None else by_name("pad_token")
        names = tuple((k, _token_name(tok_config[k])) for k in TEMPLATE_TOKENS if tok_config.get(k) is not None)
        return cls(tok, bos, eos, eos[0] if pad is None else int(pad), chat_template, names)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=_TemplateNamespace)
    return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which would change the rendered prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' training-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateNamespace(Namespace):
    """jinja's ``namespace`` refusing underscore-prefixed names (transformers' ``TemplateNamespace``)."""

    def __init__(*args, **kwargs):  # noqa: N805 -- jinja's signature trick: `self` may be a key
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)  # not self._check: a Namespace's attributes are its keys
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed names on a namespace: "
                                f"{name!r}")
