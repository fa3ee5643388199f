"""Chat templates render to exactly the token ids of transformers' ``apply_chat_template``, from
every place a checkpoint keeps its template; templates are sandboxed; prompts follow task.chat_template."""

import jinja2
import msgspec
import pytest

from core import config as C
from model.tokenizer import Tokenizer
from tests.support.textmodel import CHATML, text_tokenizer, write_tokenizer_dir

# the other template style: no whitespace control in the tags (trim_blocks/lstrip_blocks do it),
# bos/eos names, tojson, namespace, loop controls and the {% generation %} tag
PLAIN = """{{ eos_token }}{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% set ns.n = ns.n + 1 %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }} {{ {"k": message['content'] | length} | tojson }}
{% generation %}{{ message['content'] }}{% endgeneration %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant {{ ns.n }}
{% endif %}
"""
CHATS = [
    [{"role": "user", "content": "Calculate 5 - 3 - 6."}],
    [{"role": "system", "content": "Be brief & exact."}, {"role": "user", "content": "What is 1/2 + 1/4?"},
     {"role": "assistant", "content": "<answer>3/4</answer>"}, {"role": "user", "content": "ünïcode \"quotes\""}],
]


def _hf_ids(path, messages, add_generation_prompt):
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(out if isinstance(out, list) else out["input_ids"])


@pytest.mark.parametrize("template,where", [(CHATML, "config"), (CHATML, "list"), (CHATML, "jinja"),
                                            (PLAIN, "config")])
def test_rendering_matches_transformers(tmp_path, template, where):
    path = write_tokenizer_dir(tmp_path, template, where)
    tok = Tokenizer.from_dir(path)
    for messages in CHATS:
        for gen in (True, False):
            ours = tok.apply_chat(messages, add_generation_prompt=gen)
            assert ours == _hf_ids(path, messages, gen)
            assert len(ours) > 5


def test_the_template_file_wins_over_tokenizer_config(tmp_path):
    path = write_tokenizer_dir(tmp_path, CHATML, "config")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = Tokenizer.from_dir(path)
    assert tok.decode(tok.apply_chat(CHATS[0])) == "[Calculate 5 - 3 - 6.]"


def test_a_template_list_without_default_is_a_clear_error(tmp_path):
    import json

    path = write_tokenizer_dir(tmp_path, None)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "rag", "template": "y"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"\['rag', 'tool_use'\] but no template named 'default'"):
        Tokenizer.from_dir(path)


def test_templates_are_sandboxed_and_can_raise():
    tok = text_tokenizer()
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        tok.apply_chat([{"role": "tool", "content": "x"}])
    escape = text_tokenizer("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escape.apply_chat(CHATS[0])
    hidden = text_tokenizer("{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}")
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        hidden.apply_chat(CHATS[0])


def test_no_template_means_plain_prompts_and_on_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_dir(write_tokenizer_dir(tmp_path, None))
    assert tok.chat_template is None and not tok.wants_chat("auto") and not tok.wants_chat("off")
    with pytest.raises(ValueError, match="task.chat_template = 'on' but the model's tokenizer has no chat template"):
        tok.wants_chat("on")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat(CHATS[0])
    assert tok.prompt("1+1=", chat=False) == tok.encode("1+1=")  # no BOS in this checkpoint


def test_task_prompts_follow_chat_template_system_prompt_and_instruction():
    from actor.tasks.arith import ArithTask

    def task(**fields):
        return ArithTask(msgspec.structs.replace(C.Config().task, **fields), text_tokenizer())

    def text(t, tier="default"):
        return t.tok.tok.decode(list(t.prompt_tokens("Q?", tier)), skip_special_tokens=False)

    assert text(task()).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")  # auto: on
    by_tier = task(system_prompt={"default": "Be brief.", "high": "Think hard."}, instruction="Box it.")
    assert text(by_tier, "high").startswith("<|im_start|>system\nThink hard.<|im_end|>\n<|im_start|>user\nQ?\n\nBox it.")
    assert "system\nBe brief." in text(by_tier, "low")  # no "low" entry: the default one
    assert text(task(chat_template="off")) == "Q?"


# a tools block as Qwen2/Qwen3 templates write one (their tool-call format: actor/episodes.py FORMATS["qwen"])
TOOLS = """{% if tools %}<|im_start|>system
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "integer arithmetic",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}


def test_tool_schemas_render_as_transformers_renders_them(tmp_path):
    from transformers import AutoTokenizer

    from actor.tasks.arith import ArithTask

    path = write_tokenizer_dir(tmp_path, TOOLS, "config")
    messages = [{"role": "user", "content": "Q?"}]
    hf = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tools=[CALCULATOR], add_generation_prompt=True)
    assert Tokenizer.from_dir(path).apply_chat(messages, tools=[CALCULATOR]) == list(hf if isinstance(hf, list) else hf["input_ids"])
    tools = msgspec.structs.replace(C.Config().task.tools, schema=[CALCULATOR])
    task = ArithTask(msgspec.structs.replace(C.Config().task, tools=tools), Tokenizer.from_dir(path))
    text = task.tok.tok.decode(list(task.prompt_tokens("Q?")), skip_special_tokens=False)
    assert '<tools>{"type": "function", "function": {"name": "calculator"' in text and text.endswith("assistant\n")
