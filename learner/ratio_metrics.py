"""The train/inference mismatch metrics ``ratio/*`` and ``mismatch/*`` (ARCHITECTURE.md: Metric
vocabulary) from the learner's freshly recomputed log-probs and the actor's behaviour ones: float64
numpy over the response tokens, ``np.percentile`` (linear), so a figure can be reproduced from dumps.
"""

from __future__ import annotations

import math

import numpy as np

RATIO_QS = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p999", 99.9))
FIXED_KEYS = ("ratio/mean", *(f"ratio/{name}" for name, _ in RATIO_QS), "ratio/min", "ratio/max",
              "ratio/ess", "ratio/clip_frac", "mismatch/kl_k3", "mismatch/abs_logp_diff_mean",
              "mismatch/abs_logp_diff_p99")


def percentiles(values, qs) -> list[float]:
    """``np.percentile`` (linear interpolation) of ``values`` at each q in 0..100; NaNs if empty."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    if arr.size == 0:
        return [math.nan] * len(qs)
    return [float(v) for v in np.percentile(arr, qs)]


def _host(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; .double() first since numpy has no bfloat16
        x = x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def ratio_metrics(logp, behaviour_logp, mask, staleness=None, eps_high: float = 2.0) -> dict[str, float]:
    """The metrics over the response tokens (``mask`` > 0) of ``[B, T]`` log-probs (torch or numpy), all NaN
    without one; ``staleness`` (``[B]`` or ``[B, T]``) adds the ratio p99 per lag and, at lag 0 (numerics alone),
    the |Δlog p| p99. ``mismatch/kl_k3`` estimates KL(behaviour || learner), unbiased and >= 0."""
    lp, bl = _host(logp), _host(behaviour_logp)
    m = _host(mask) > 0
    if not lp.shape == bl.shape == m.shape:
        raise ValueError(f"logp {lp.shape}, behaviour_logp {bl.shape} and mask {m.shape} must have one shape")
    log_r = (lp - bl)[m]
    n = log_r.size
    if n == 0:
        return dict.fromkeys(FIXED_KEYS, math.nan)
    with np.errstate(over="ignore"):  # an overflowing ratio is reported as inf, not hidden
        rho = np.exp(log_r)
    abs_diff, qs = np.abs(log_r), percentiles(rho, [q for _, q in RATIO_QS])
    out = {"ratio/mean": float(rho.mean()), **{f"ratio/{name}": v for (name, _), v in zip(RATIO_QS, qs)},
           "ratio/min": float(rho.min()), "ratio/max": float(rho.max()),
           "ratio/ess": float(rho.sum() ** 2 / (n * np.square(rho).sum())),
           "ratio/clip_frac": float((rho > eps_high).mean()),
           "mismatch/kl_k3": float((np.expm1(log_r) - log_r).mean()),
           "mismatch/abs_logp_diff_mean": float(abs_diff.mean()),
           "mismatch/abs_logp_diff_p99": percentiles(abs_diff, [99.0])[0]}
    if staleness is not None:
        out.update(_p99_by_staleness(rho, abs_diff, staleness, m))
    return out


def _p99_by_staleness(rho: np.ndarray, abs_diff: np.ndarray, staleness, m: np.ndarray) -> dict[str, float]:
    s = _host(staleness)
    if s.shape == m.shape[:1]:
        s = np.broadcast_to(s[:, None], m.shape)
    if s.shape != m.shape:
        raise ValueError(f"staleness must be [B] or [B, T] = {m.shape}, got {s.shape}")
    s = s[m].astype(np.int64)
    out = {f"ratio/p99_by_staleness/{v}": percentiles(rho[s == v], [99.0])[0] for v in np.unique(s).tolist()}
    if "ratio/p99_by_staleness/0" in out:
        out["mismatch/abs_logp_diff_p99_by_staleness/0"] = percentiles(abs_diff[s == 0], [99.0])[0]
    return out
