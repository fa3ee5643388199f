"""Consumption/staleness policies: plain functions keyed on policy version::

    policy(available, learner_version, max_staleness, n) -> (take_order, drops)

``available``: the groups resident and not leased to a learner, in arrival order. ``take_order`` holds
at most ``n`` groups, none past the staleness bound: that is the guarantee (ARCHITECTURE.md: Versions
and staleness; :func:`core.messages.staleness`). ``drops`` leave the buffer, counted as ``stale``.
Both serve the oldest data first; they differ in when stale data is dropped (at once, or only when
it would have been served) and in what "oldest" means (oldest weights, or oldest arrival).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable, Protocol, Sequence

from core.messages import staleness

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


def get(name: str) -> Callable:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown buffer policy {name!r}; choose one of {sorted(POLICIES)}") from None
