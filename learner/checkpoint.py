"""Atomic, pickle-free checkpoints.

Layout of ``run_dir/checkpoints/step_000042/``::

    model/            HF-format weights + config + tokenizer (AutoModelForCausalLM loads it)
    optim.safetensors AdamW state tensors, keyed "<param index>.<name>"
    rng.safetensors   torch RNG state
    meta.json         step, version, stage, data position, consumed count, optimiser hyper-params,
                      python RNG state
    COMPLETE          written last: a directory without it is never loaded

Writes go to a hidden temporary directory, every file is fsynced, the directory is renamed into
place, and only then is ``COMPLETE`` written and the parent fsynced. Nothing is pickled, so a
checkpoint from an untrusted source cannot execute code when loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import torch
from safetensors.torch import load_file, save_file

from learner.model import Qwen3, save_pretrained

MARKER = "COMPLETE"
KEEP = 2


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_dir(final: str, write) -> str:
    """Call ``write(tmp_dir)``, then make its result appear at ``final`` atomically."""
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(final)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write(tmp)
        _fsync_tree(tmp)
        old = None
        if os.path.exists(final):
            # keep the previous copy until the new one is in place: a crash in between leaves
            # the old directory (with its marker) under a name `latest` still finds
            old = os.path.join(parent, f".old-{os.path.basename(final)}-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        with open(os.path.join(final, MARKER), "w") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def tokenizer_files_from(model_dir: str) -> dict[str, bytes]:
    out = {}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        p = os.path.join(model_dir, name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                out[name] = f.read()
    return out


def save_model(model: Qwen3, final: str, base_dir: str) -> str:
    return atomic_dir(final, lambda tmp: save_pretrained(model, tmp, tokenizer_files_from(base_dir)))


def save(ckpt_root: str, step: int, model: Qwen3, opt: torch.optim.Optimizer, base_dir: str, meta: dict) -> str:
    final = os.path.join(ckpt_root, f"step_{step:06d}")

    def write(tmp: str) -> None:
        save_pretrained(model, os.path.join(tmp, "model"), tokenizer_files_from(base_dir))
        sd = opt.state_dict()
        tensors = {}
        for idx, state in sd["state"].items():
            for k, v in state.items():
                t = v if torch.is_tensor(v) else torch.tensor(v)
                tensors[f"{idx}.{k}"] = t.detach().contiguous().clone()
        save_file(tensors, os.path.join(tmp, "optim.safetensors"))
        save_file({"torch": torch.get_rng_state()}, os.path.join(tmp, "rng.safetensors"))
        py_state = random.getstate()
        full_meta = {
            **meta,
            "step": step,
            "param_groups": sd["param_groups"],
            "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(full_meta, f, indent=2)

    atomic_dir(final, write)
    _prune(ckpt_root)
    return final


def _prune(ckpt_root: str) -> None:
    done = complete_checkpoints(ckpt_root)
    for old in done[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    # leftovers of writers that were killed mid-checkpoint (their pid is gone)
    for name in os.listdir(ckpt_root):
        if name.startswith((".tmp-", ".old-")) and not _pid_alive(int(name.rsplit("-", 1)[1])):
            shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def complete_checkpoints(ckpt_root: str) -> list[str]:
    if not os.path.isdir(ckpt_root):
        return []
    names = sorted(n for n in os.listdir(ckpt_root) if n.startswith("step_"))
    return [os.path.join(ckpt_root, n) for n in names if os.path.exists(os.path.join(ckpt_root, n, MARKER))]


def latest(ckpt_root: str) -> str | None:
    done = complete_checkpoints(ckpt_root)
    return done[-1] if done else None


def load(path: str, model: Qwen3, opt: torch.optim.Optimizer) -> dict:
    """Restore weights, optimiser and RNG states in place; returns meta.json."""
    if not os.path.exists(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER})")
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    weights = load_file(os.path.join(path, "model", "model.safetensors"))
    model.load_state_dict(weights, strict=True)
    flat = load_file(os.path.join(path, "optim.safetensors"))
    state: dict[int, dict] = {}
    for key, t in flat.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(load_file(os.path.join(path, "rng.safetensors"))["torch"])
    v, internal, gauss = meta["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    return meta
