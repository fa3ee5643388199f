"""``run_dir/trained_keys.jsonl``: what each learner step trained and the version it published (its use in a
recovery: ARCHITECTURE.md, Recovery). Exactly-once is checkable after the fact, and each line is fsynced before
its version is published, so a restarted learner publishes above the newest ever: weights never go back in time.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

from core.files import atomic_write
from learner.checkpoint import WriteError

TRAINED = "trained_keys.jsonl"
ROLLED_BACK = "trained_keys.rolled_back.jsonl"
RECENT_STEPS = 64  # kept lines whose keys the buffer may still serve (their Consumed lost in a crash)


def append(run_dir: str, step: int, version: int, keys) -> None:
    append_durable(os.path.join(run_dir, TRAINED), "the trained-keys audit",
                   [{"step": step, "version": version, "keys": [list(k) for k in keys]}])


def append_durable(path: str, what: str, records: list[dict]) -> None:
    """Append JSON lines to ``path``, fsynced; a failure is a WriteError naming ``what``."""
    try:
        _append(path, records)
    except OSError as e:
        raise WriteError(what, path, e) from None


def _append(path: str, records: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())


def read(path: str) -> list[dict]:
    """The lines of an audit file; a line torn by a crash described no published step."""
    out = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


@dataclass
class Recovery:
    version: int  # the version to publish the checkpoint's weights under
    retired: set = field(default_factory=set)  # trained keys the buffer may serve again: never train them
    rolled_back_steps: int = 0


def recover(run_dir: str, ckpt_step: int, ckpt_version: int) -> Recovery:
    """Cut the audit back to ``ckpt_step``. Idempotent: a crash inside it recovers the same way."""
    path = os.path.join(run_dir, TRAINED)
    lines = read(path)
    kept = [r for r in lines if r["step"] <= ckpt_step]
    cut = [r for r in lines if r["step"] > ckpt_step]
    newest = max([ckpt_version] + [r["version"] for r in lines + read(os.path.join(run_dir, ROLLED_BACK))])
    if cut:
        _append(os.path.join(run_dir, ROLLED_BACK), cut)
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    retired = {tuple(k) for r in kept[-RECENT_STEPS:] for k in r["keys"]}
    return Recovery(ckpt_version if newest == ckpt_version else newest + 1, retired, len(cut))
