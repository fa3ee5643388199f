"""Make a real-sized HF checkpoint offline: a byte-level BPE tokenizer trained on local text and a
random-initialised Llama (SmolLM-135M shape by default), written by ``transformers`` itself.

No model hub is reachable from the machines driftrl is developed on, so this is how the 100M+
scale path is exercised: the directory is what a user brings (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json), and driftrl
must load, train and write it back like any downloaded checkpoint. Weights are random, so the
model knows nothing: a run on it measures speed and memory, not learning.

    python bench/checkpoint.py OUT_DIR [--preset 135m|tiny] [--vocab 16384]

Needs ``pip install -e '.[bench]'`` (transformers). The tokenizer corpus is the Python standard
library's source (present wherever Python is) plus arithmetic text, ~10 MB by default.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sysconfig
import time

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PRESETS = {  # SmolLM-135M's shape (vocab aside: ours is trained on far less text)
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),
}


def corpus(max_bytes: int, seed: int = 0):
    """Text for the tokenizer: stdlib sources, then arithmetic and short instructions."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        with open(path, encoding="utf-8", errors="ignore") as f:
            text = f.read()
        total += len(text)
        yield text
    rng = random.Random(seed)
    for _ in range(20000):
        a, b = rng.randint(0, 10**6), rng.randint(0, 10**6)
        yield f"What is {a} + {b}? The answer is {a + b}. Put the final answer in \\boxed{{{a + b}}}.\n"


def train_tokenizer(vocab: int, max_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(max_bytes), trainer=trainer)
    return tok


def write_tokenizer(tok, out: str) -> dict:
    tok.save(os.path.join(out, "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "chat_template": CHATML, "model_max_length": 2048}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}


def write_model(out: str, preset: str, vocab: int, special: dict, seed: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                      bos_token_id=None, eos_token_id=special["eos_token_id"][0],
                      pad_token_id=special["pad_token_id"], **PRESETS[preset])
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"]).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="135m")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--corpus-mb", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    tok = train_tokenizer(args.vocab, int(args.corpus_mb * 1e6))
    print(f"tokenizer: {tok.get_vocab_size()} tokens in {time.time() - t0:.0f}s", flush=True)
    special = write_tokenizer(tok, args.out)
    params = write_model(args.out, args.preset, tok.get_vocab_size(), special, args.seed)
    print(json.dumps({"out": os.path.abspath(args.out), "params": params, "vocab": tok.get_vocab_size(),
                      "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
