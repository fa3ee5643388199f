"""Per-token KL estimators (Schulman, "Approximating KL divergence", 2020).

``kl_per_token(logp, ref_logp, est)`` estimates KL(p || q) from tokens sampled from p, where
``logp = log p(x)`` and ``ref_logp = log q(x)``; with ``log r = ref_logp - logp``:

* k1 = -log r              unbiased, high variance, negative on single tokens;
* k2 = (log r)^2 / 2       biased, low variance, always >= 0;
* k3 = (r - 1) - log r     unbiased, low variance, always >= 0 (the usual choice).

For the loss, p is the policy and q the frozen reference, so this is KL(pi || ref) and gradients
flow through ``logp``. For the mismatch metric, pass ``logp=behaviour`` and ``ref_logp=learner``
to estimate KL(behaviour || learner) from the actor's own samples.
"""

from __future__ import annotations

import torch
from torch import Tensor


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (ref_logp - logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    log_r = ref_logp - logp
    # expm1 keeps r - 1 exact for the tiny log-ratios of a near-matching pair
    return torch.expm1(log_r) - log_r


ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}


def kl_per_token(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Elementwise estimate of KL(p || q); see the module docstring for the argument roles."""
    try:
        fn = ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {sorted(ESTIMATORS)}")
    return fn(logp, ref_logp)
