"""HF model directories (safetensors, sharded or not, plus tokenizer files) <-> :class:`Decoder`. Loading checks
config.json and the safetensors headers before reading anything (never a partly random model), then reads a
shard at a time (peak: the model plus one tensor); pickled ``*.bin`` is refused. Saving keeps the input's config
keys and writes a tied head once, so transformers loads the directory as is."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.decoder import DTYPES, ArchConfig, Decoder

log = logging.getLogger("driftrl.hf")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names; anything else is quantised or not weights
# transformers < 4.31 saved the (non-persistent) rope buffer; transformers ignores it on load, so do we
IGNORED_SUFFIX = "rotary_emb.inv_freq"


def read_config(path: str) -> dict:
    return json.loads(Path(path, "config.json").read_text())


def weight_files(path: str) -> list[str]:
    """The safetensors files of ``path``: the shards its index names, or ``model.safetensors``."""
    if os.path.exists(os.path.join(path, INDEX)):
        files = sorted(set(json.loads(Path(path, INDEX).read_text())["weight_map"].values()))
        if absent := [name for name in files if not os.path.exists(os.path.join(path, name))]:
            raise FileNotFoundError(f"{path}/{INDEX} lists shards that are not there: {absent}")
        return files
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    if any(name.endswith(".bin") for name in os.listdir(path)):
        raise ValueError(f"{path} holds only pickled *.bin weights, which driftrl never loads: convert them "
                         "to safetensors (transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise FileNotFoundError(f"no model.safetensors or {INDEX} in {path}")


def _headers(path: str, files: list[str]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (file, shape, safetensors dtype) of every tensor, read from the headers only."""
    found = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                if key in found:
                    raise ValueError(f"{path}: tensor {key} is in both {found[key][0]} and {name}")
                piece = f.get_slice(key)
                found[key] = (name, tuple(piece.get_shape()), piece.get_dtype())
    return found


def _check(path: str, cfg: ArchConfig, found: dict, expected: dict) -> None:
    """ValueError listing every tensor that is missing, unexpected, misshapen or not a float."""
    names = set(found)
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")  # a tied copy some writers keep; compared after reading
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    shapes = [f"{k} {found[k][1]} != {expected[k]}" for k in sorted(names & set(expected))
              if found[k][1] != expected[k]]
    dtypes = [f"{k} {found[k][2]}" for k in sorted(names) if found[k][2] not in FLOAT_DTYPES]
    if missing or unexpected or shapes or dtypes:
        raise ValueError(
            f"{path} does not match its config.json (model_type={cfg.model_type!r}, tie_word_embeddings="
            f"{cfg.tie_word_embeddings}, attention_bias={cfg.attention_bias}, mlp_bias={cfg.mlp_bias}): "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}, wrong shapes {shapes[:8]}, "
            f"non-float dtypes {dtypes[:8]}")


def _read(path: str, files: list[str], found: dict) -> dict[str, torch.Tensor]:
    """Every tensor, one shard at a time, each cast to FP32 as it arrives."""
    state, start, total = {}, time.perf_counter(), 0
    for i, name in enumerate(files, 1):
        t0, nbytes = time.perf_counter(), 0
        keys = [k for k, (file, _, _) in found.items() if file == name]
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in keys:
                tensor = f.get_tensor(key)
                nbytes += tensor.numel() * tensor.element_size()
                state[key] = tensor.float()
        total += nbytes
        log.info("loaded %s shard %d/%d %s: %d tensors, %.1f MB in %.2f s", path, i, len(files), name,
                 len(keys), nbytes / 1e6, time.perf_counter() - t0)
    log.info("loaded %s: %.1f MB in %.2f s", path, total / 1e6, time.perf_counter() - start)
    return state


def load_pretrained(path: str) -> Decoder:
    """The model in ``path``, its weights cast to FP32 as they are read."""
    cfg = ArchConfig.from_hf(read_config(path))
    files = weight_files(path)
    found = {k: v for k, v in _headers(path, files).items() if not k.endswith(IGNORED_SUFFIX)}
    _check(path, cfg, found, Decoder.shapes(cfg))
    state = _read(path, files, found)
    head = state.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None  # a tied head's stored copy
    if head is not None and not torch.equal(head, state["model.embed_tokens.weight"]):
        raise ValueError(f"{path}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                         "model.embed_tokens.weight; set tie_word_embeddings=false to use both")
    return Decoder.from_state(cfg, state)


def tokenizer_files(model_dir: str) -> dict[str, bytes]:
    """The tokenizer files ``model_dir`` has, to be written beside new weights."""
    return {name: Path(model_dir, name).read_bytes() for name in TOKENIZER_FILES if Path(model_dir, name).exists()}


def save_pretrained(model: Decoder, path: str, extra_files: dict[str, bytes] | None = None) -> None:
    """config.json, model.safetensors (the model's dtype) and ``extra_files`` into ``path``; not atomic."""
    names = {v: k for k, v in DTYPES.items()}
    target = next(model.parameters()).dtype
    if target not in names:
        raise ValueError(f"cannot save weights as {target}: expected one of {sorted(DTYPES)}")
    os.makedirs(path, exist_ok=True)
    t0 = time.perf_counter()
    state = {k: v.detach().to(target).contiguous() for k, v in model.state_dict().items()}
    Path(path, INDEX).unlink(missing_ok=True)  # a leftover index would make loaders read old shards
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    Path(path, "config.json").write_text(json.dumps(model.cfg.to_hf(names[target]), indent=2))
    for name, data in (extra_files or {}).items():
        Path(path, name).write_bytes(data)
    log.info("saved %s (%s): %.1f MB in %.2f s", path, names[target],
             sum(v.numel() * v.element_size() for v in state.values()) / 1e6, time.perf_counter() - t0)
