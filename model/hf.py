"""HF-format model directories: load into / save from :class:`model.decoder.Qwen3`.

A directory holds ``config.json``, ``*.safetensors`` and the tokenizer's files; driftrl writes
the same layout back (``transformers.AutoModelForCausalLM.from_pretrained`` loads it), carrying
the input's tokenizer files along so every checkpoint is usable on its own.
"""

from __future__ import annotations

import json
import os

from model.decoder import DTYPES, ArchConfig, Qwen3

# files that travel with the weights: what a tokenizer and a generation loop need
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def load_pretrained(path: str, dtype: str = "float32") -> Qwen3:
    from safetensors.torch import load_file

    cfg = ArchConfig.from_hf(read_config(path))
    model = Qwen3(cfg)
    files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match qwen3: missing={missing} unexpected={unexpected}")
    return model.to(DTYPES[dtype])


def tokenizer_files(model_dir: str) -> dict[str, bytes]:
    """The tokenizer files of ``model_dir`` (those it has), to be written beside new weights."""
    out = {}
    for name in TOKENIZER_FILES:
        p = os.path.join(model_dir, name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                out[name] = f.read()
    return out


def save_pretrained(model: Qwen3, path: str, extra_files: dict[str, bytes] | None = None) -> None:
    """Write config.json + model.safetensors (+ extra files such as tokenizer.json) into ``path``.

    Plain writes: callers that need atomicity write into a temporary directory and rename it
    (``core.files.atomic_dir``).
    """
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf(), f, indent=2)
    for name, data in (extra_files or {}).items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
