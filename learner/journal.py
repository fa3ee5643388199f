"""What the learner trained since its newest checkpoint, so a learner crash loses no group and
trains none twice.

Why a journal: the buffer retires a group once it receives ``Consumed``, so after a crash the
groups trained since the newest checkpoint -- whose effect on the weights died with the process
-- exist nowhere else. Each step appends its groups (``core.messages.encode`` bytes) and the
version it is about to publish, fsynced before that version is published and before ``Consumed``
is sent; a checkpoint rewrites the journal to a base frame (its version and any groups still
waiting to be trained again) plus the frames since the checkpoint before it (the fallback should
the newest one turn out damaged). Recovery subtracts what the checkpoint already holds, so
frames kept longer than needed are harmless.

File ``run_dir/learner_journal.bin``: frames ``[u32 length][u32 crc32][msgpack payload]``,
payload ``{"step", "version", "groups": [bytes]}``. A torn last frame (a crash mid-append) ends
the read: that step's ``Consumed`` was never sent, so the buffer still leases its groups and
serves them again once the new learner says Hello.

Recovery (:func:`recover`) from a checkpoint at step ``S``, version ``Vc``:

- ``trained_keys.jsonl`` is cut back to step ``S``; the cut lines move to
  ``trained_keys.rolled_back.jsonl``, so every key the file lists is in the current weights.
- The journal's groups that the cut file does not list are trained again, first. A group every
  token of which comes from a version newer than ``Vc`` was sampled by weights that no longer
  exist: it is dropped and counted (``learner/dropped_rolled_back``); one too stale at the
  recovered version is dropped as any stale group is (``learner/dropped_stale``).
- The checkpoint's weights are published as ``Vc`` when nothing newer was ever published (a
  clean resume), else as (newest version ever published) + 1, read from the journal: versions
  never repeat, so weight transports, actors' admission and the buffer's staleness stay
  monotonic and staleness is never negative.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field

import msgspec

from core import messages as M
from core.files import atomic_write, fsync_path
from learner.checkpoint import WriteError

JOURNAL = "learner_journal.bin"
TRAINED = "trained_keys.jsonl"
ROLLED_BACK = "trained_keys.rolled_back.jsonl"
RECENT_STEPS = 64  # audit lines whose keys may still be served again (a Consumed lost in the crash)
_HEAD = struct.Struct("<II")
_GROUP = M.decoder(M.RolloutGroup)


class Journal:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, JOURNAL)

    def append(self, step: int, version: int, groups: list[bytes]) -> None:
        frame = _frame({"step": step, "version": version, "groups": groups})
        try:
            with open(self.path, "ab") as f:
                f.write(frame)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise WriteError("the learner journal", self.path, e) from None

    def reset(self, version: int, pending: list[bytes] = (), keep_after: int | None = None) -> None:
        """After a checkpoint at ``version``: a base frame (``version``, the groups still to be
        trained again), plus the frames newer than ``keep_after`` -- the previous checkpoint's
        version, so that one can stand in if the newest turns out damaged."""
        old = [] if keep_after is None else [f for f in self.read() if f["version"] > keep_after]
        data = b"".join(_frame(f) for f in [{"step": -1, "version": version, "groups": list(pending)}, *old])
        try:
            atomic_write(self.path, data)
        except OSError as e:
            raise WriteError("the learner journal", self.path, e) from None

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        out, at = [], 0
        while at + _HEAD.size <= len(data):
            n, crc = _HEAD.unpack_from(data, at)
            body = data[at + _HEAD.size: at + _HEAD.size + n]
            if len(body) != n or zlib.crc32(body) != crc:
                break  # torn tail: see the module docstring
            out.append(msgspec.msgpack.decode(body))
            at += _HEAD.size + n
        return out


def _frame(payload: dict) -> bytes:
    body = msgspec.msgpack.encode(payload)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


# ---- trained_keys.jsonl: the audit of what each step trained -----------------------------------

def audit(run_dir: str, step: int, version: int, keys) -> None:
    """Append-only record of what each step trained on: exactly-once is checkable after the fact."""
    path = os.path.join(run_dir, TRAINED)
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "version": version, "keys": [list(k) for k in keys]}) + "\n")
    except OSError as e:
        raise WriteError("the trained-keys audit", path, e) from None


def sync_audit(run_dir: str) -> None:
    """Before a checkpoint: the audit must be as durable as the weights it describes."""
    path = os.path.join(run_dir, TRAINED)
    if os.path.exists(path):
        fsync_path(path)


def cut_audit(run_dir: str, step: int) -> tuple[list[dict], int]:
    """Keep the lines of steps <= ``step``; move the rest to the rolled-back file."""
    path = os.path.join(run_dir, TRAINED)
    if not os.path.exists(path):
        return [], 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept, cut = [], []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the crash: it described no published step
            continue
        (kept if rec["step"] <= step else cut).append(rec)
    if cut or len(kept) != len(lines):
        with open(os.path.join(run_dir, ROLLED_BACK), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in cut)
            f.flush()
            os.fsync(f.fileno())
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return kept, len(cut)


# ---- recovery ------------------------------------------------------------------------------------

@dataclass
class Recovery:
    version: int  # the version to publish the checkpoint's weights under
    replay: list[M.RolloutGroup] = field(default_factory=list)  # train these again, first
    retired: set = field(default_factory=set)  # keys the buffer may serve again: never train them
    rolled_back_steps: int = 0
    dropped_rolled_back: int = 0
    dropped_stale: int = 0  # too old at ``version`` to be trained again


def recover(run_dir: str, ckpt_step: int, ckpt_version: int, max_staleness: int) -> Recovery:
    """See the module docstring. Idempotent: a crash inside it recovers the same way again."""
    journal = Journal(run_dir)
    frames = journal.read()
    newest = max([ckpt_version] + [f["version"] for f in frames])
    rec = Recovery(ckpt_version if newest == ckpt_version else newest + 1)
    kept, rec.rolled_back_steps = cut_audit(run_dir, ckpt_step)
    in_weights = {tuple(k) for r in kept for k in r["keys"]}
    seen = set()
    for g in (_GROUP.decode(b) for f in frames for b in f["groups"]):
        if g.key in seen or g.key in in_weights:
            continue
        seen.add(g.key)
        oldest = g.min_version()
        if oldest > ckpt_version:
            rec.dropped_rolled_back += 1
        elif rec.version - oldest > max_staleness:
            rec.dropped_stale += 1
        else:
            rec.replay.append(g)
    journal.reset(rec.version, [M.encode(g) for g in rec.replay])  # durable before it is published
    rec.retired = seen | {tuple(k) for r in kept[-RECENT_STEPS:] for k in r["keys"]}
    return rec
