"""A model directory's own tokenizer and its special token ids.

Tasks tokenise through this, and engines stop on its EOS ids, so special ids come from the
checkpoint, never from module constants. Where each id is looked up, first hit wins:

    bos   config.json ``bos_token_id`` · tokenizer_config.json ``bos_token`` (by name)
    eos   generation_config.json ``eos_token_id`` · config.json ``eos_token_id`` (int or list) ·
          tokenizer_config.json ``eos_token``
    pad   config.json ``pad_token_id`` · tokenizer_config.json ``pad_token`` · the first EOS
          (padding is masked everywhere, so any in-vocabulary id is correct)

Chat templates render exactly as ``transformers``' ``apply_chat_template`` does
(``transformers/utils/chat_template_utils.py``): the template comes from ``chat_template.jinja``
(what transformers 5 writes) or else tokenizer_config.json's ``chat_template`` (a string, or a
list of ``{name, template}`` of which "default" is used); it is rendered by jinja2's immutable
sandbox -- templates ship with checkpoints, so they are untrusted code -- with
``trim_blocks``/``lstrip_blocks``, the ``raise_exception``/``strftime_now`` globals, the
non-HTML-escaping ``tojson`` filter, the ``{% generation %}`` tag and the special tokens' names
(``bos_token``, ``eos_token``, ...) as variables; the text is then encoded without adding special
tokens again (a template that wants BOS writes ``{{ bos_token }}`` itself).
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# the special tokens transformers passes to a template by name (``special_tokens_map``)
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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


def read_chat_template(path: str, tok_config: dict) -> str | None:
    """The model directory's chat template: ``chat_template.jinja`` wins over tokenizer_config.json
    (transformers' order); None when it has none."""
    file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.exists(file):
        with open(file, encoding="utf-8") as f:
            return f.read()
    value = tok_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if "default" not in named:
        raise ValueError(f"{path}/tokenizer_config.json: chat_template lists {sorted(map(str, named))} "
                         "but no template named 'default'")
    return named["default"]


def _template_tokens(tok_config: dict) -> tuple[tuple[str, str], ...]:
    return tuple((k, _token_name(tok_config[k])) for k in TEMPLATE_TOKENS if tok_config.get(k) is not None)


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
        """Token ids of ``text``, no special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content"}`` dicts) rendered by the chat template,
        as ``transformers``' ``apply_chat_template(messages, add_generation_prompt=...)`` gives."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja, no chat_template "
                             "in tokenizer_config.json)")
        text = _compile(self.chat_template).render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **dict(self.template_tokens))
        return self.encode(text)

    def wants_chat(self, mode: str) -> bool:
        """Whether prompts go through the chat template: ``mode`` is task.chat_template ("on",
        "off", or "auto" = when the checkpoint has one)."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"task.chat_template = {mode!r}: expected auto, on or off")
        if mode == "on" and self.chat_template is None:
            raise ValueError("task.chat_template = 'on' but the model's tokenizer has no chat template "
                             f"(no {CHAT_TEMPLATE_FILE}, no chat_template in tokenizer_config.json)")
        return mode == "on" or (mode == "auto" and self.chat_template is not None)

    def prompt(self, text: str, chat: bool, system: str = "") -> list[int]:
        """Prompt ids of a user's ``text``: the chat template (with a ``system`` message when not
        empty) followed by the assistant's header, or else BOS (if any), ``system`` and ``text`` as
        plain text: a model without a template still sees which tier it is asked for."""
        if chat:
            system_msg = [{"role": "system", "content": system}] if system else []
            return self.apply_chat([*system_msg, {"role": "user", "content": text}])
        return ([] if self.bos_id is None else [self.bos_id]) + self.encode(system + text)

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok_config = _read(os.path.join(path, "tokenizer_config.json"))
        return cls.build(HFTokenizer.from_file(file), _read(os.path.join(path, "config.json")),
                         _read(os.path.join(path, "generation_config.json")), tok_config,
                         read_chat_template(path, tok_config))

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
        return cls(tok, bos, eos, eos[0] if pad is None else int(pad), chat_template, _template_tokens(tok_config))


# ---- chat templates: transformers' sandboxed jinja environment ------------------------------

def _require_jinja() -> None:
    """jinja2 >= 3.1.6, as transformers requires: older versions have known sandbox escapes, and a
    checkpoint's template is untrusted code."""
    try:
        import jinja2
    except ImportError:
        raise ImportError("rendering a chat template needs jinja2>=3.1.6: pip install jinja2 "
                          "(or set task.chat_template=off)") from None
    version = tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < (3, 1, 6):
        raise ImportError(f"jinja2 {jinja2.__version__} has known sandbox escapes: pip install -U 'jinja2>=3.1.6'")


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    _require_jinja()
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=_namespace_class())
    return env.from_string(template)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which would change the rendered prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in
    transformers); for a prompt it renders its body unchanged."""
    import jinja2.ext
    from jinja2 import nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


@functools.cache
def _namespace_class():
    """jinja's ``namespace`` refusing underscore-prefixed names, so a template cannot reach
    CPython internals through attributes it stores (transformers' ``TemplateNamespace``)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed names on a namespace: {name!r}")

    class TemplateNamespace(Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 -- jinja's signature trick: `self` may be a key
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace
