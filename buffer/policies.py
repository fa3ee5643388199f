"""Consumption/staleness policies: plain functions keyed on policy version.

A policy sees the *available* groups (resident and not leased to a learner), in arrival order,
and decides which to hand out and which to drop::

    policy(available, learner_version, max_staleness, n) -> (take_order, drops)

``take_order`` holds at most ``n`` groups; ``drops`` are removed from the buffer and counted as
``stale``. Neither list may contain a group whose staleness exceeds the bound in ``take_order``:
that is the guarantee (ARCHITECTURE.md: Versions and staleness; :func:`core.messages.staleness`).

Worked example. Five groups arrived in the order A..E, whose oldest token versions are::

    group        A  B  C  D  E
    min_version  3  1  4  2  4

The learner is at v = 5 with ``max_staleness = 2``, so staleness = 5 - min_version is
A 2, B 4, C 1, D 3, E 1: B and D are too old to train on. Asked for n = 2:

* ``drop_stale`` drops B and D at once (eager) and serves the oldest-version groups first,
  because they are the next to expire: take_order = A(3), C(4), E(4) cut to [A, C]; E stays.
* ``oldest_first`` walks in arrival order and stops once it has n: A (take), B (drop, stale),
  C (take) -> take [A, C], drops [B]. D is not looked at yet; it is dropped by a later call if it
  is still too old then (lazy: a group is only dropped at the moment it would have been served).

Both consume the oldest data first; they differ in when stale data is discarded and whether
"oldest" means oldest weights (``drop_stale``) or oldest arrival (``oldest_first``).
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
