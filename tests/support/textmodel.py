"""A small text checkpoint for the external-task tests: a real byte-level BPE tokenizer with a
Qwen-style ChatML template, and a tiny Qwen3 that answers in the tasks' format.

The tokenizer is what a real checkpoint ships -- ``tokenizers`` ByteLevel BPE (trained here on
generated text, so every string encodes), ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>``
specials, ``tokenizer_config.json`` with the template and the EOS/pad names, a
``generation_config.json`` whose EOS is a list -- so ``transformers.AutoTokenizer`` loads the
same directory (the chat-template tests compare against it). The model is pre-trained for a few
dozen steps by the real recipe (``model.basemodel.pretrain``) on reasoning-gym prompts, only so
that it ends its answers with EOS: completions are then checked by the real scorers instead of
all scoring 0 as truncated. Built once per pytest process into a temporary directory.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import random
import shutil
import tempfile

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's template without the tools branch: a default system message, roles checked
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}\n"
    "    {%- elif message.role in ['user', 'assistant'] %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('unknown role ' + message.role) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
TINY_MODEL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
              "model.intermediate_size=64", "model.pretrain_steps=60", "model.pretrain_batch=32"]
PRETRAIN_DATASETS = ["basic_arithmetic", "chain_sum"]


def corpus(n: int = 600, seed: int = 0) -> list[str]:
    """Generated lines like the tasks' prompts and answers, chat markup included."""
    rng = random.Random(seed)
    words = ["Calculate", "State the final answer to the following arithmetic problem:", "What is", "Solve",
             "Put the final answer in", "\\boxed{", "\\frac{1}{2}", "<answer>", "</answer>", "You are a helpful "
             "assistant.", "system", "user", "assistant", "The answer is"]
    lines = []
    for _ in range(n):
        expr = " ".join(f"{rng.randint(0, 999)} {rng.choice('+-*/')}" for _ in range(rng.randint(1, 4)))
        lines.append(f"{rng.choice(words)} {expr} {rng.randint(0, 99)} = {rng.choice(words)}\n")
    return lines


@functools.lru_cache(maxsize=None)
def build_text_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def special_ids() -> dict:
    tok = build_text_tokenizer()
    return {"bos_token_id": None, "eos_token_id": tok.token_to_id("<|im_end|>"),
            "pad_token_id": tok.token_to_id("<|endoftext|>")}


def text_tokenizer_files(template: str | None = CHATML, where: str = "config") -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and generation_config.json; the ``template`` goes
    into tokenizer_config.json (``where="config"``), as a ``[{name, template}]`` list there
    (``"list"``) or into ``chat_template.jinja`` (``"jinja"``, transformers 5's layout)."""
    ids = special_ids()
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "model_max_length": 512}
    files = {"tokenizer.json": build_text_tokenizer().to_str().encode(),
             "generation_config.json": json.dumps({"eos_token_id": [ids["eos_token_id"], ids["pad_token_id"]]}).encode()}
    if template is not None and where == "jinja":
        files["chat_template.jinja"] = template.encode()
    elif template is not None:
        cfg["chat_template"] = template if where == "config" else [{"name": "default", "template": template},
                                                                   {"name": "tool_use", "template": "unused"}]
    files["tokenizer_config.json"] = json.dumps(cfg, indent=2).encode()
    return files


def write_tokenizer_dir(path, template: str | None = CHATML, where: str = "config") -> str:
    """A directory with the tokenizer's files and a config.json holding its special ids."""
    for name, data in text_tokenizer_files(template, where).items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**special_ids(), "vocab_size": build_text_tokenizer().get_vocab_size()}, f)
    return str(path)


def text_tokenizer(template: str | None = CHATML):
    from model.tokenizer import Tokenizer

    files = text_tokenizer_files(template)
    return Tokenizer.build(build_text_tokenizer(), special_ids(), json.loads(files["generation_config.json"]),
                           json.loads(files["tokenizer_config.json"]), template)


class _AnswerCorpus:
    """What ``model.basemodel.pretrain`` reads of a task: its prompts, and as the completion to
    learn, the reference answer (then EOS)."""

    def __init__(self, task):
        self.task, self.tok = task, task.tok

    def sample(self, rng, split="train"):
        return self.task.sample(rng, split)

    def pretrain_completion(self, prompt, rng, model_cfg) -> str:
        return prompt.answer

    def pretrain_recipe(self, model_cfg) -> dict:
        return {}


@functools.lru_cache(maxsize=None)
def text_model_dir() -> str:
    """The tiny text checkpoint (HF layout), pre-trained just enough to end answers with EOS."""
    import torch

    from actor.tasks.gym import GymTask
    from core import config as C
    from model.basemodel import pretrain

    path = tempfile.mkdtemp(prefix="driftrl-textmodel-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    cfg = C.load(None, [*TINY_MODEL, "task.name=gym", f"task.datasets={json.dumps(PRETRAIN_DATASETS)}"])
    torch.set_num_threads(1)
    pretrain(cfg, _AnswerCorpus(GymTask(cfg.task, text_tokenizer())), text_tokenizer_files(), special_ids(), path)
    return path
