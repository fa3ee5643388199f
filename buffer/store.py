"""The resident replay groups and their exactly-once bookkeeping. Pure: no sockets, no disk.

A group is identified by its key ``(actor_id, seq)``. Its life::

    offer() --ok--> resident --take()--> leased --consume()--> consumed
                       |                   |
                       |                   +--release() (learner restarted or gone)--> resident
                       +--take() finds it stale--> dropped("stale")

``offer`` answers ``duplicate`` for every key ever accepted (resident, leased, consumed or
dropped), so a resend can never be inserted twice; ``busy`` when the capacity in groups or bytes
is reached (nothing is ever evicted silently); ``rejected`` when the group is already too stale
on arrival. The accounting invariant ``accepted == consumed + sum(dropped) + resident`` holds
after every call and is reported by :meth:`Store.invariant_ok`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from buffer import policies
from core.funnel import length_bucket, lost_metrics
from core.messages import staleness

Key = tuple[str, int]


@dataclass(slots=True, eq=False)
class Entry:
    key: Key
    min_version: int
    nbytes: int  # bytes held in memory (the encoded group): what capacity_bytes limits
    length: int  # tokens of the longest completion, for the drop-bias buckets
    raw: Any = None  # encoded RolloutGroup, handed to the learner without re-encoding
    order: int = 0  # arrival number, set by the store
    lessee: str | None = None  # learner holding it, if leased


def entry_from_group(group, raw=None, min_version: int | None = None) -> Entry:
    """The store's view of a validated group; ``min_version`` if the caller has it, else ``group.min_version()``."""
    if min_version is None:
        min_version = group.min_version()
    return Entry(group.key, min_version, len(raw) if raw is not None else group.nbytes(), group.length(), raw)


class SeenKeys:
    """Every key ever accepted, compactly: per actor the highest seq seen plus the gaps below it, inclusive
    ``(lo, hi)`` intervals, sorted (actors count 0, 1, 2, ...: a rejected group or a restart leaves one)."""

    def __init__(self):
        self._hwm: dict[str, int] = {}
        self._gaps: dict[str, list[tuple[int, int]]] = {}

    def __contains__(self, key: Key) -> bool:
        actor, seq = key
        if seq > self._hwm.get(actor, -1):
            return False
        gaps = self._gaps.get(actor)
        if not gaps:
            return True
        i = bisect.bisect_right(gaps, (seq, float("inf"))) - 1
        return not (i >= 0 and gaps[i][0] <= seq <= gaps[i][1])

    def add(self, key: Key) -> None:
        actor, seq = key
        hwm = self._hwm.get(actor, -1)
        if seq > hwm:
            if seq > hwm + 1:
                self._gaps.setdefault(actor, []).append((hwm + 1, seq - 1))
            self._hwm[actor] = seq
            return
        gaps = self._gaps.get(actor)
        if not gaps:
            return
        i = bisect.bisect_right(gaps, (seq, float("inf"))) - 1
        if i < 0 or not gaps[i][0] <= seq <= gaps[i][1]:
            return
        lo, hi = gaps.pop(i)
        for part in ((seq + 1, hi), (lo, seq - 1)):
            if part[0] <= part[1]:
                gaps.insert(i, part)

    def next_seq(self, actor: str) -> int:
        return self._hwm.get(actor, -1) + 1


@dataclass
class Counters:
    accepted: int = 0
    consumed: int = 0
    duplicates: int = 0
    busy: int = 0
    recovered: int = 0  # resident groups rebuilt from disk at start (counted in accepted)
    consumed_unknown: int = 0  # Consumed for keys not resident (a resend after a restart)
    consumed_not_leased: int = 0  # Consumed for resident keys not leased to that learner
    rejected: Counter = field(default_factory=Counter)  # at arrival, by reason
    dropped: Counter = field(default_factory=Counter)  # after acceptance, by reason
    # rejects and drops by the response-length bucket (core/funnel.py): a staleness bound that mostly
    # drops long rollouts biases training toward short answers, visibly so here
    lost_by_len: Counter = field(default_factory=Counter)


class Store:
    def __init__(self, capacity_groups: int, capacity_bytes: int, max_staleness: int = 1,
                 policy: str = "drop_stale"):
        self.capacity_groups = capacity_groups
        self.capacity_bytes = capacity_bytes
        self.max_staleness = max_staleness
        self.policy = policy
        policies.get(policy)  # fail at construction on a bad name
        self.resident: dict[Key, Entry] = {}  # insertion order == arrival order
        self.seen = SeenKeys()
        self.counters = Counters()
        self.depth_bytes = 0
        self.leased = 0
        # set when an offer was refused for capacity, cleared when anything leaves: a learner
        # waiting for more groups than fit must then be served what there is (no deadlock)
        self.saturated = False
        self._order = 0

    # ---- admission -------------------------------------------------------------------------

    def offer(self, entry: Entry, learner_version: int | None = None) -> tuple[str, str]:
        """Try to accept a group; returns ``(status, reason)``."""
        c = self.counters
        if entry.key in self.seen:
            c.duplicates += 1
            return "duplicate", ""
        reason = "too_large" if entry.nbytes > self.capacity_bytes else "stale" if learner_version is not None \
            and staleness(learner_version, entry.min_version) > self.max_staleness else None
        if reason is not None:
            self.reject(entry.length, reason)
            return "rejected", reason
        if len(self.resident) >= self.capacity_groups or \
                self.depth_bytes + entry.nbytes > self.capacity_bytes:
            c.busy += 1
            self.saturated = True
            return "busy", ""
        self._insert(entry)
        c.accepted += 1
        return "ok", ""

    def reject(self, length: int, reason: str) -> None:
        """A group refused at arrival (here, or by the server's validation: ``invalid``)."""
        self.counters.rejected[reason] += 1
        self.counters.lost_by_len[length_bucket(length)] += 1

    def restore(self, entry: Entry) -> None:
        """Re-insert a group recovered from disk (it was accepted by an earlier incarnation)."""
        if entry.key in self.resident:
            return
        self._insert(entry)
        self.counters.accepted += 1
        self.counters.recovered += 1

    def _insert(self, entry: Entry) -> None:
        self._order += 1
        entry.order, entry.lessee = self._order, None
        self.resident[entry.key] = entry
        self.seen.add(entry.key)
        self.depth_bytes += entry.nbytes

    # ---- sampling ----------------------------------------------------------------------------

    def available(self) -> int:
        return len(self.resident) - self.leased

    def take(self, n: int, learner_version: int, lessee: str = "learner", at_least: int = 1):
        """Lease up to ``n`` fresh groups to ``lessee`` -> ``(taken, dropped)``; below ``at_least`` none is
        leased, but the stale groups the policy discards are removed and returned in ``dropped`` anyway."""
        avail = [e for e in self.resident.values() if e.lessee is None]
        take, drops = policies.get(self.policy)(avail, learner_version, self.max_staleness, n)
        for e in drops:
            self._remove(e)
            self.counters.dropped["stale"] += 1
            self.counters.lost_by_len[length_bucket(e.length)] += 1
        take = take[:n]
        if len(take) < max(at_least, 1):
            return [], drops
        for e in take:
            e.lessee = lessee
        self.leased += len(take)
        return take, drops

    def consume(self, keys: Iterable[Key], lessee: str | None = None) -> list[Entry]:
        """The learner trained on these: they leave for good. Keys not resident, or (with ``lessee``) not
        leased to that learner (it cannot have trained on them), are counted and ignored."""
        done = []
        for key in keys:
            e = self.resident.get(key)
            if e is None:
                self.counters.consumed_unknown += 1
                continue
            if lessee is not None and e.lessee != lessee:
                self.counters.consumed_not_leased += 1
                continue
            self._remove(e)
            self.counters.consumed += 1
            done.append(e)
        return done

    def release(self, lessee: str) -> int:
        """Make the groups leased to ``lessee`` available again (that learner restarted)."""
        n = 0
        for e in self.resident.values():
            if e.lessee == lessee:
                e.lessee = None
                n += 1
        self.leased -= n
        return n

    def _remove(self, e: Entry) -> None:
        del self.resident[e.key]
        self.depth_bytes -= e.nbytes
        if e.lessee is not None:
            self.leased -= 1
        self.saturated = False

    # ---- reporting ---------------------------------------------------------------------------

    def invariant_ok(self) -> bool:
        c = self.counters
        return c.accepted == c.consumed + sum(c.dropped.values()) + len(self.resident)

    def stats(self) -> dict[str, float]:
        c = self.counters
        out = {
            "buffer/depth": float(len(self.resident)),
            "buffer/depth_bytes": float(self.depth_bytes),
            "buffer/leased": float(self.leased),
            "buffer/accepted": float(c.accepted),
            "buffer/recovered": float(c.recovered),
            "buffer/consumed": float(c.consumed),
            "buffer/dropped_stale": float(c.dropped["stale"] + c.rejected["stale"]),
            "buffer/duplicates": float(c.duplicates),
            "buffer/busy": float(c.busy),
            "buffer/consumed_ignored": float(c.consumed_unknown + c.consumed_not_leased),
            "buffer/rejected": float(sum(c.rejected.values())),
            "buffer/invariant_ok": 1.0 if self.invariant_ok() else 0.0,
        }
        out.update(lost_metrics({"stale_at_admission": c.rejected["stale"], "stale_in_buffer": c.dropped["stale"],
                                 "too_large": c.rejected["too_large"], "invalid": c.rejected["invalid"]},
                                c.lost_by_len))
        out["funnel/accepted"] = float(c.accepted - c.recovered)
        out["funnel/resident"] = float(len(self.resident))
        return out
