"""Acting on the ratio tail before the optimiser step: an adaptive staleness limit and guard-rails. Pure: no I/O.

:class:`StalenessController` moves the limit by one, judging the ratio p99 at the highest lag present
(the lag the limit answers for): lower above ``target``, raise below ``target * (1 - hysteresis)``
(the band between holds: no flapping), never within ``dwell_steps`` of the last change, always within
``[lo, hi]`` (tests/unit/test_control.py walks through an example).

:class:`GuardRails` fire *at* a threshold (0 or None: off): from above for ratio p99/max, KL k3 and
the lag-0 |Δlog p| p99 (the engine/learner numerics gap alone), from below for ratio min (a low tail
starves gradients), and on any non-finite ratio/mismatch value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BY_LAG = "ratio/p99_by_staleness/"
ACTIONS = ("warn", "skip_step", "pause_actors", "rollback")
# (guard name, metric key, fires above its threshold?); the config key of each is guard_<name>
GUARDS = (
    ("ratio_p99", "ratio/p99", True),
    ("ratio_max", "ratio/max", True),
    ("ratio_min", "ratio/min", False),
    ("kl_k3", "mismatch/kl_k3", True),
    ("abs_logp_diff_p99_s0", "mismatch/abs_logp_diff_p99_by_staleness/0", True),
)
NONFINITE = "nonfinite"
GUARD_NAMES = tuple(name for name, _, _ in GUARDS) + (NONFINITE,)
_WATCHED = ("ratio/", "mismatch/")  # the prefixes the non-finite guard looks at


@dataclass(frozen=True)
class Decision:
    limit: int
    changed: bool
    reason: str


@dataclass(frozen=True)
class Trip:
    guard: str
    value: float
    threshold: float
    reason: str


def highest_lag(metrics: dict) -> tuple[int, float] | None:
    """``(lag, ratio p99 at it)`` for the highest lag with a finite p99 in ``metrics``."""
    found = [(int(k[len(BY_LAG):]), v) for k, v in metrics.items() if k.startswith(BY_LAG)
             and k[len(BY_LAG):].isdigit() and isinstance(v, float) and math.isfinite(v)]
    return max(found, default=None)


class StalenessController:
    def __init__(self, limit: int, lo: int, hi: int, target: float, hysteresis: float, dwell_steps: int,
                 start_step: int = 0):
        self.limit, self.lo, self.hi = limit, lo, hi
        self.target, self.hysteresis, self.dwell = target, hysteresis, dwell_steps
        self.last_change = start_step
        self.changes = 0

    def update(self, step: int, metrics: dict) -> Decision:
        """The limit after the step ``step`` whose ratio metrics are ``metrics``."""
        seen = highest_lag(metrics)
        if seen is None:
            return Decision(self.limit, False, "hold: no ratio p99 by lag in this step")
        lag, p99 = seen
        at = f"ratio p99 at lag {lag} = {p99:.3f}"
        if step - self.last_change < self.dwell:
            return Decision(self.limit, False, f"hold: {at}, dwell ({step - self.last_change} of "
                                               f"{self.dwell} steps since the last change)")
        raise_below = self.target * (1 - self.hysteresis)
        if p99 > self.target and self.limit > self.lo:
            return self._move(step, -1, f"{at} > target {self.target:.3f}")
        if p99 < raise_below and self.limit < self.hi:
            return self._move(step, +1, f"{at} < {raise_below:.3f} (target {self.target:.3f} x "
                                        f"(1 - hysteresis {self.hysteresis:g}))")
        return Decision(self.limit, False, f"hold: {at}, limit {self.limit} in [{self.lo}, {self.hi}]")

    def _move(self, step: int, delta: int, why: str) -> Decision:
        old, self.limit = self.limit, self.limit + delta
        self.last_change, self.changes = step, self.changes + 1
        return Decision(self.limit, True, f"{why}: max_staleness {old} -> {self.limit}")


class GuardRails:
    """``thresholds``: a guard name of :data:`GUARDS` -> its threshold (missing, 0 or None: off)."""

    def __init__(self, thresholds: dict[str, float | None], nonfinite: bool = True):
        self.active = [(n, k, above, float(thresholds[n])) for n, k, above in GUARDS if thresholds.get(n)]
        self.nonfinite = nonfinite

    def check(self, metrics: dict) -> list[Trip]:
        """Every guard that fires on one step's ``metrics`` (keys absent from it are not checked)."""
        trips = []  # in GUARD_NAMES order: the first is the one reported as the latest trip
        for name, key, above, t in self.active:
            v = metrics.get(key)
            if not isinstance(v, float) or not math.isfinite(v):
                continue  # absent (no lag-0 tokens this step), or the non-finite guard's
            if (v >= t) if above else (v <= t):
                trips.append(Trip(name, v, t, f"{key} = {v:.4g} {'>=' if above else '<='} {name} threshold {t:.4g}"))
        bad = sorted(k for k, v in metrics.items() if k.startswith(_WATCHED) and isinstance(v, float)
                     and not math.isfinite(v))
        if self.nonfinite and bad:
            v = metrics[bad[0]]
            trips.append(Trip(NONFINITE, v, math.nan, f"non-finite {', '.join(bad[:4])} (first: {bad[0]} = {v})"))
        return trips


@dataclass
class Verdict:
    trips: list[Trip]
    action: str | None  # None: no guard fired
    decision: Decision | None

    @property
    def blocks_step(self) -> bool:
        return self.action in ("skip_step", "rollback")

    def reason(self) -> str:
        return "; ".join(t.reason for t in self.trips)


class Control:
    """The learner's control state: both of the above, the pause of ``pause_actors``, the counters."""

    def __init__(self, cc, max_staleness: int, start_step: int = 0):
        self.cc, self.configured = cc, max_staleness
        self.controller = StalenessController(max_staleness, cc.staleness_min, cc.staleness_max,
                                              cc.ratio_p99_target, cc.hysteresis, cc.dwell_steps,
                                              start_step) if cc.adaptive_staleness else None
        self.guards = GuardRails({n: getattr(cc, f"guard_{n}") for n, _, _ in GUARDS}, cc.guard_nonfinite)
        self.fired = dict.fromkeys(GUARD_NAMES, 0)
        self.acted = dict.fromkeys(ACTIONS, 0)
        self.paused, self.clean_steps = False, 0
        self.last: tuple[Trip, int] | None = None  # the latest guard that fired, and at which step

    @property
    def max_staleness(self) -> int:
        return self.controller.limit if self.controller is not None else self.configured

    def observe(self, step: int, metrics: dict) -> Verdict:
        """Check step ``step``'s metrics (after forward/backward, before the optimiser)."""
        trips = self.guards.check(metrics)
        decision = self.controller.update(step, metrics) if self.controller is not None else None
        action = self.cc.guard_action if trips else None
        for t in trips:
            self.fired[t.guard] += 1
        if trips:
            self.acted[action] += 1
            self.last = (trips[0], step)
        return Verdict(trips, action, decision)

    def pause(self) -> None:
        self.paused, self.clean_steps = True, 0

    def resume(self) -> None:
        self.paused = False

    def after_step(self, verdict: Verdict) -> bool:
        """Count a clean step while paused; True when the pause ends here (``pause_steps``)."""
        if not self.paused or verdict.trips:
            return False
        self.clean_steps += 1
        self.paused = self.clean_steps < self.cc.pause_steps
        return not self.paused

    def metrics(self) -> dict[str, float]:
        out = {"control/max_staleness": float(self.max_staleness),
               "control/staleness_changes": float(self.controller.changes if self.controller else 0),
               "control/paused": float(self.paused),
               **{f"control/guard/{n}": float(c) for n, c in self.fired.items()},
               **{f"control/action/{a}": float(c) for a, c in self.acted.items()}}
        if self.last is not None:
            trip, step = self.last
            value = trip.value if math.isfinite(trip.value) else math.nan  # inf is no measurement
            out.update({"control/last_value": value, "control/last_threshold": trip.threshold,
                        "control/last_step": float(step)})
        return out


class Poisoned:
    """Version intervals ``(after, upto]`` of rolled-back weights: a group carrying any token of
    such a version was sampled by weights that no longer exist and were judged bad."""

    def __init__(self, intervals=()):
        self.intervals: list[tuple[int, int]] = [(int(a), int(b)) for a, b in intervals]

    def add(self, after: int, upto: int) -> None:
        if upto > after:
            self.intervals.append((after, upto))

    def hit(self, versions: np.ndarray) -> bool:
        """True when any of ``versions`` lies in an interval."""
        if not self.intervals or not versions.size:
            return False
        lo, hi = int(versions.min()), int(versions.max())
        return any(lo <= b and hi > a and bool(((versions > a) & (versions <= b)).any())
                   for a, b in self.intervals)
