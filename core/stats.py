"""Small numeric helpers shared by the roles and the monitor (numpy only, no torch).

Empty input gives NaN rather than an exception: a metric that has nothing to summarise this
interval is reported as "no value" (null in metrics.jsonl), not as a crash in a training loop.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Iterable

import numpy as np


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of ``values``; NaN for empty input."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    if arr.size == 0:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return float(np.percentile(arr, q))


def histogram_counts(int_values: Iterable[int]) -> dict[int, int]:
    """Count of each integer value, keys sorted ascending."""
    counts = Counter(int(v) for v in np.asarray(list(int_values)).ravel())
    return dict(sorted(counts.items()))


def dense_histogram(int_values: Iterable[int], upto: int | None = None) -> list[float]:
    """Counts indexed by value 0..max (or 0..upto): the wire form of ``staleness/hist``.

    Negative values are a caller bug (staleness is never negative) and raise ValueError.
    """
    counts = histogram_counts(int_values)
    if counts and min(counts) < 0:
        raise ValueError(f"dense_histogram needs non-negative values, got {min(counts)}")
    top = max(counts, default=-1) if upto is None else upto
    return [float(counts.get(i, 0)) for i in range(top + 1)]


class RateMeter:
    """Exponentially weighted events-per-second (e.g. tokens/s) over a half-life in seconds.

    ``add(n)`` records n events now; ``rate`` is the smoothed rate. The first interval seeds the
    estimate directly, so the meter does not ramp up from zero for several half-lives.
    """

    def __init__(self, halflife_s: float = 10.0, clock=time.monotonic):
        if halflife_s <= 0:
            raise ValueError("halflife_s must be > 0")
        self.halflife_s = halflife_s
        self._clock = clock
        self._last = clock()
        self._rate: float | None = None
        self._pending = 0.0
        self.total = 0.0

    def add(self, n: float, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        dt = now - self._last
        self.total += n
        if dt <= 0:
            # same instant: fold the events into the next interval instead of dividing by zero
            self._pending += n
            return self.rate
        n += self._pending
        self._pending = 0.0
        inst = n / dt
        if self._rate is None:
            self._rate = inst
        else:
            w = 0.5 ** (dt / self.halflife_s)
            self._rate = w * self._rate + (1.0 - w) * inst
        self._last = now
        return self._rate

    @property
    def rate(self) -> float:
        return 0.0 if self._rate is None else self._rate
