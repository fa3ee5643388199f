"""Atomic, verified checkpoints (ARCHITECTURE.md: Recovery; their files: A run directory). Nothing is pickled,
so an untrusted checkpoint cannot run code; a failed write raises :class:`WriteError` and leaves nothing torn.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import random
import shutil

from core import heartbeat
from core.files import atomic_dir
from core.proc import pid_alive

log = logging.getLogger("driftrl.learner.checkpoint")
MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
KEEP = 2


class WriteError(RuntimeError):
    def __init__(self, what: str, path: str, err: OSError):
        super().__init__(f"cannot write {what} {path}: {err.strerror or err}")


class DamagedCheckpoint(RuntimeError):
    """A checkpoint whose files do not match its manifest (or that has none)."""


def write_dir(what: str, final: str, write) -> str:
    """``write(tmp)`` fills a directory that appears at ``final`` whole (``COMPLETE`` marker), else WriteError."""
    try:
        return atomic_dir(final, write, marker=MARKER)
    except OSError as e:
        raise WriteError(what, final, e) from None


def save_model(backend, final: str) -> str:
    """The backend's weights as an HF-format directory at ``final``, atomically, with its manifest."""
    def write(tmp: str) -> None:
        backend.save_model(tmp)
        _write_manifest(tmp)

    return write_dir("the final model", final, write)


def verify_model(model_dir: str) -> None:
    """A model directory of a run (final_model/, a checkpoint's model/) against its manifest;
    DamagedCheckpoint if it has none or differs. Another model directory is not checked."""
    ours = [d for d in (model_dir, os.path.dirname(os.path.abspath(model_dir)))
            if os.path.exists(os.path.join(d, MARKER))]
    if ours:
        verify(ours[0])


def save(ckpt_root: str, step: int, backend, meta: dict) -> str:
    final = os.path.join(ckpt_root, f"step_{step:06d}")

    def write(tmp: str) -> None:
        full_meta = {**meta, **backend.save_state(tmp), "step": step, "python_rng": random.getstate()}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(full_meta, f, indent=2)
        _write_manifest(tmp)

    write_dir("the checkpoint", final, write)
    _prune(ckpt_root)
    return final


def _sha256(path: str) -> str:
    heartbeat.pulse()  # hashing a large checkpoint is not a hang
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(root: str) -> None:
    files = [os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names]
    with open(os.path.join(root, MANIFEST), "w") as f:
        json.dump({p: {"bytes": os.path.getsize(os.path.join(root, p)), "sha256": _sha256(os.path.join(root, p))}
                   for p in sorted(files) if p not in (MANIFEST, MARKER)}, f, indent=1)


def verify(path: str) -> None:
    """Raise DamagedCheckpoint unless every file of ``path`` matches its manifest."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            want = json.load(f)
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"{path}: unreadable {MANIFEST} ({e})") from None
    for rel, entry in want.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise DamagedCheckpoint(f"{path}: {rel} is missing")
        if os.path.getsize(full) != entry["bytes"]:
            raise DamagedCheckpoint(f"{path}: {rel} has {os.path.getsize(full)} bytes, "
                                    f"the manifest says {entry['bytes']} (truncated?)")
        if _sha256(full) != entry["sha256"]:
            raise DamagedCheckpoint(f"{path}: {rel} does not match its sha256 (corrupted)")


def _prune(ckpt_root: str) -> None:
    done = complete_checkpoints(ckpt_root)
    for old in done[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    # leftovers of writers that were killed mid-checkpoint (their pid is gone)
    for name in os.listdir(ckpt_root):
        if name.startswith((".tmp-", ".old-")) and not pid_alive(int(name.rsplit("-", 1)[1])):
            shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)


def complete_checkpoints(ckpt_root: str) -> list[str]:
    markers = glob.glob(os.path.join(glob.escape(ckpt_root), "step_*", MARKER))
    return sorted(os.path.dirname(m) for m in markers)


def latest(ckpt_root: str) -> str | None:
    """The newest complete checkpoint that passes :func:`verify`; damaged ones are skipped."""
    for path in reversed(complete_checkpoints(ckpt_root)):
        try:
            verify(path)
            return path
        except DamagedCheckpoint as e:
            log.warning("skipping damaged checkpoint: %s; falling back to an older one", e)
    return None


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json (step, version, ...), without loading or verifying its tensors."""
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def load(path: str, backend) -> dict:
    """Verify, then restore the backend's state and the python RNG in place; returns meta.json."""
    if not os.path.exists(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER})")
    verify(path)
    meta = read_meta(path)
    backend.load_state(path, meta)
    v, internal, gauss = meta["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    return meta
