"""Resume inside a generation (ARCHITECTURE.md, Recovery): the batch being generated -- finished samples and
each unfinished sample's prefix with its log-probs and versions -- saved as one msgpack file, replaced by rename;
a restarted actor continues it. A group handed over while the file lists it keeps its seq there, so a restart
re-sends it under that seq and the buffer answers "duplicate" rather than training it twice.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib

import msgspec

from actor.engines import Sample
from core.files import atomic_write
from core.messages import staleness

log = logging.getLogger(__name__)


class SavedGroup(msgspec.Struct, array_like=True, frozen=True):
    prompt_id: str
    prompt: list[int]
    tier: str
    difficulty: float
    answer: str
    limit: int  # its samples' max_new_tokens
    samples: list[Sample | None]  # None: not started; finish_reason "": a prefix still being generated
    seq: int = -1  # >= 0: complete, and handed to the client with this seq


class SavedBatch(msgspec.Struct, array_like=True, frozen=True):
    actor_id: str
    start_version: int
    groups: list[SavedGroup]


_decoder = msgspec.msgpack.Decoder(SavedBatch)


def path(run_dir: str, actor_id: str) -> str:
    # a digest, not the id: an actor id is arbitrary text and must never become a path
    return os.path.join(run_dir, "partial", hashlib.blake2b(actor_id.encode(), digest_size=16).hexdigest())


def save(where: str, batch: SavedBatch) -> None:
    """Replace the saved batch (no fsync: a killed process's writes survive in the page cache)."""
    os.makedirs(os.path.dirname(where), exist_ok=True)
    atomic_write(where, msgspec.msgpack.encode(batch), durable=False, mode=0o600)


def clear(where: str) -> None:
    pathlib.Path(where).unlink(missing_ok=True)


def _problem(g: SavedGroup, group_size: int) -> str:
    if len(g.samples) != group_size or not g.prompt or g.limit < 1:
        return f"{len(g.samples)} samples for a group of {group_size}, or no prompt or limit"
    for s in filter(None, g.samples):
        if not len(s.tokens) == len(s.logprobs) == len(s.versions) or len(s.tokens) > g.limit:
            return "a sample whose tokens, log-probs and versions differ in length or pass its limit"
        if s.finish_reason not in ("", "stop", "length") or (not s.finish_reason and len(s.tokens) >= g.limit):
            return "a sample whose finish reason does not fit it"
        if s.finish_reason and not s.tokens:
            return "a finished sample with no tokens"
    if g.seq >= 0 and not all(s is not None and s.finish_reason for s in g.samples):
        return "a group handed over before its samples finished"
    return ""


def load(where: str, actor_id: str, group_size: int) -> SavedBatch | None:
    """The batch an earlier incarnation saved, checked; None if there is none. A file that does not decode
    or does not fit this run is set aside (``.bad``) with a warning: its groups are generated anew."""
    try:
        raw = pathlib.Path(where).read_bytes()
    except FileNotFoundError:
        return None
    try:
        batch = _decoder.decode(raw)
        why = "another actor's" if batch.actor_id != actor_id else next(
            (w for g in batch.groups if (w := _problem(g, group_size))), "")
    except msgspec.DecodeError as e:
        why = f"undecodable ({e})"
    if why:
        log.warning("ignoring the saved partial batch %s: %s", where, why)
        os.replace(where, where + ".bad")
        return None
    return batch


def split(batch: SavedBatch, version: int, max_staleness: int) -> tuple[list[SavedGroup], list[SavedGroup]]:
    """``(kept, dropped)``: a group whose oldest token is already more than ``max_staleness`` behind
    ``version`` would be refused by the buffer however it ends, so it is not continued."""
    kept, dropped = [], []
    for g in batch.groups:  # the oldest saved token's version; ``version`` (fresh) when it has none yet
        oldest = min((v for s in g.samples if s is not None for v in s.versions), default=version)
        (dropped if staleness(version, oldest) > max_staleness and g.seq < 0 else kept).append(g)
    return kept, dropped


def tokens(groups: list[SavedGroup]) -> int:
    return sum(len(s.tokens) for g in groups for s in g.samples if s is not None)
