"""Actor-side admission control by staleness (ARCHITECTURE.md: Versions and staleness), as plain arithmetic.

AReaL-style capacity: an actor may have started at most ``(max_staleness + v + 1) * share``
groups while the learner is at version ``v``, where ``share`` is its part of
``groups_per_step``. Groups the buffer rejected or dropped give their slot back, otherwise one
dropped group at ``max_staleness = 0`` would stall the run forever.

Worked example (share = 8, max_staleness = 1): at v = 0 the actor may start 16 groups; the
learner's first step (v -> 1) consumes 8 of them, all made at version 0, staleness 0 at
consumption; the next 8 (also version 0) are consumed at v = 1, staleness 1; only once v = 1
may groups 17..24 start, and they are consumed at v = 2 at the earliest: staleness <= 1.

The learner's control (``learner/control.py``) may move ``max_staleness`` during a run (it reaches
the actor in the buffer's acks) and may pause the actors: while ``paused`` nothing may start. A
lowered limit only delays new starts; groups already started keep their slots and the buffer
drops, and gives back, whatever turns out too stale for the new limit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    share: int
    max_staleness: int
    started: int = 0
    returned: int = 0
    paused: bool = False

    def limit(self, version: int) -> int:
        return (self.max_staleness + version + 1) * self.share

    def allowed(self, version: int) -> int:
        """How many more groups may start now."""
        if self.paused:
            return 0
        return max(0, self.limit(version) - (self.started - self.returned))

    def start(self, n: int) -> None:
        self.started += n

    def give_back(self, n: int = 1) -> None:
        self.returned += n

    @classmethod
    def resumed(cls, share: int, max_staleness: int, version: int, in_flight: int) -> "Admission":
        """After a restart: everything before ``version`` was consumed; ``in_flight`` are unacked."""
        return cls(share, max_staleness, started=version * share + in_flight)
