"""Atomic, pickle-free checkpoints.

Layout of ``run_dir/checkpoints/step_000042/``::

    model/            HF-format weights + config + tokenizer (AutoModelForCausalLM loads it)
    ...               the backend's own state (torch: optim.safetensors, rng.safetensors)
    meta.json         step, version, stage, data position, consumed count, the backend's metadata
                      (optimiser hyper-params), python RNG state
    COMPLETE          written last: a directory without it is never loaded

Writes go to a hidden temporary directory, every file is fsynced, the directory is renamed into
place, and only then is ``COMPLETE`` written (``core.files.atomic_dir``). Nothing is pickled, so
a checkpoint from an untrusted source cannot execute code when loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil

from core.files import atomic_dir

MARKER = "COMPLETE"
KEEP = 2


def save_model(backend, final: str) -> str:
    """The backend's weights as an HF-format directory at ``final``, atomically."""
    return atomic_dir(final, backend.save_model, marker=MARKER)


def save(ckpt_root: str, step: int, backend, meta: dict) -> str:
    final = os.path.join(ckpt_root, f"step_{step:06d}")

    def write(tmp: str) -> None:
        py_state = random.getstate()
        full_meta = {**meta, **backend.save_state(tmp), "step": step,
                     "python_rng": [py_state[0], list(py_state[1]), py_state[2]]}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(full_meta, f, indent=2)

    atomic_dir(final, write, marker=MARKER)
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


def load(path: str, backend) -> dict:
    """Restore the backend's state and the python RNG in place; returns meta.json."""
    if not os.path.exists(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER})")
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    backend.load_state(path, meta)
    v, internal, gauss = meta["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    return meta
