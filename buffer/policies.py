"""Consumption/staleness policies: plain functions keyed on policy version, and the wait for groups in
generation (:class:`StaleWait`)::

    policy(available, learner_version, max_staleness, n) -> (take_order, drops)

``available``: the groups resident and not leased to a learner, in arrival order. ``take_order`` holds
at most ``n`` groups, none past the staleness bound: that is the guarantee (ARCHITECTURE.md: Versions
and staleness; :func:`core.messages.staleness`). ``drops`` leave the buffer, counted as ``stale``.
Both serve the oldest data first; they differ in when stale data is dropped (at once, or only when
it would have been served) and in what "oldest" means (oldest weights, or oldest arrival).
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Callable, Protocol, Sequence

from core.messages import staleness

log = logging.getLogger("driftrl.buffer")

_AGE = attrgetter("min_version", "order")  # oldest weights first, then arrival; C-speed sort key


class Versioned(Protocol):
    min_version: int
    order: int


def drop_stale(available: Sequence[Versioned], learner_version: int, max_staleness: int,
               n: int | None = None):
    """Eager: drop every stale group now; serve the oldest-version groups first."""
    fresh, drops = [], []
    for g in available:
        (drops if staleness(learner_version, g.min_version) > max_staleness else fresh).append(g)
    fresh.sort(key=_AGE)
    return (fresh if n is None else fresh[:n]), drops


def oldest_first(available: Sequence[Versioned], learner_version: int, max_staleness: int,
                 n: int | None = None):
    """Lazy FIFO: serve in arrival order, dropping only the stale groups passed on the way."""
    take, drops = [], []
    for g in available:
        if n is not None and len(take) >= n:
            break
        (drops if staleness(learner_version, g.min_version) > max_staleness else take).append(g)
    return take, drops


POLICIES: dict[str, Callable] = {"drop_stale": drop_stale, "oldest_first": oldest_first}


class StaleWait:
    """``buffer.stale_strategy = wait``: the start version of each actor's oldest group in generation
    (its ``InFlight`` reports), and whether the learner's request must wait for one: it would be stale
    after the learner's next step. An actor waited for ``wait_s`` is forgotten until it reports again.

    >>> w = StaleWait(wait_s=30); w.report("a0", 5)
    >>> w.holds(request_id=1, stale_from=5, now=0.0), w.holds(1, 4, 0.0), w.holds(1, 5, 31.0), w.timeouts
    (True, False, False, 1)
    """

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self._oldest: dict[str, list] = {}  # actor -> [start version, when a request began waiting for it]
        self.held = self.timeouts = 0  # requests held; actors given up on
        self._last_held = -1

    def report(self, actor: str, oldest: int) -> None:
        """-1: none in generation. Until then, a new report keeps the wait's clock (whatever version it
        names), so no sequence of reports holds a request past ``wait_s`` without the actor finishing."""
        if oldest < 0:
            self._oldest.pop(actor, None)
        else:
            self._oldest.setdefault(actor, [oldest, None])[0] = oldest

    def holds(self, request_id: int, stale_from: int, now: float) -> bool:
        """Whether a group started at or before version ``stale_from`` is still in generation."""
        waits = False
        for actor, entry in list(self._oldest.items()):
            if entry[0] > stale_from:
                continue
            entry[1] = entry[1] if entry[1] is not None else now
            if now - entry[1] < self.wait_s:
                waits = True
            else:
                del self._oldest[actor]
                self.timeouts += 1
                log.warning("stale_strategy=wait: gave up waiting %.0fs for %s's groups of version %d",
                            self.wait_s, actor, entry[0])
        self.held += waits and request_id != self._last_held
        self._last_held = request_id if waits else self._last_held
        return waits


def get(name: str) -> Callable:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown buffer policy {name!r}; choose one of {sorted(POLICIES)}") from None
