"""The wire form of ``staleness/hist`` (numpy only, no torch)."""

from __future__ import annotations

import numpy as np


def dense_histogram(int_values) -> list[float]:
    """Counts indexed by value 0..max; a negative value (staleness never is) raises ValueError."""
    arr = np.asarray(list(int_values), dtype=np.int64).ravel()
    if arr.size and arr.min() < 0:
        raise ValueError(f"dense_histogram needs non-negative values, got {arr.min()}")
    return [float(c) for c in np.bincount(arr)]
