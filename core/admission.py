"""Actor-side admission by staleness (ARCHITECTURE.md: Versions and staleness), AReaL-style: an actor
may have started at most ``(max_staleness + v + 1) * share`` groups at learner version ``v`` (``share``:
its part of ``groups_per_step``). A group the buffer rejected or dropped gives its slot back, or one
dropped group at ``max_staleness = 0`` would stall the run. The learner's control may move the limit
(a lowered one only delays new starts) and pause the actors.
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

    def allowed(self, version: int) -> int:
        """How many more groups may start now."""
        limit = (self.max_staleness + version + 1) * self.share
        return 0 if self.paused else max(0, limit - (self.started - self.returned))

    def start(self, n: int) -> None:
        self.started += n

    def give_back(self, n: int = 1) -> None:
        self.returned += n

    @classmethod
    def resumed(cls, share: int, max_staleness: int, version: int, in_flight: int) -> "Admission":
        """After a restart: everything before ``version`` was consumed; ``in_flight`` are unacked."""
        return cls(share, max_staleness, started=version * share + in_flight)
