"""Symmetric PPO-clip with the ratio to the actor's behaviour log-probs: ``loss_t = -min(r A,
clip(r, 1 - eps, 1 + eps) A)``, ``r = exp(logp - behaviour_logp)``. Tokens on the clipped side get
exactly zero gradient: the baseline against which Ring-Zero keeps every token. ``loss/clip_frac``:
their fraction (not ratio_metrics' ``ratio/clip_frac``, rho > eps_high; both are logged).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.losses import LossInputs, clean, finish, masked_mean


def ppo_clip_loss(inp: LossInputs, eps_clip: float = 0.2) -> tuple[Tensor, dict[str, float]]:
    m, logp, behaviour_logp, adv = clean(inp)
    ratio = torch.exp(logp - behaviour_logp)
    per_token, clipped = clipped_surrogate(ratio, adv, eps_clip)
    stats = {"loss/clip_frac": masked_mean(clipped.to(ratio.dtype), m)}
    return finish(per_token, m, logp, inp, stats)


def clipped_surrogate(ratio: Tensor, adv: Tensor, eps_clip: float) -> tuple[Tensor, Tensor]:
    """Per-token ``-min(r A, clip(r) A)`` and the bool mask of tokens where the clip is active."""
    if not 0 < eps_clip < 1:
        raise ValueError(f"eps_clip must be in (0, 1), got {eps_clip}")
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv
    active = ((adv > 0) & (ratio > 1.0 + eps_clip)) | ((adv < 0) & (ratio < 1.0 - eps_clip))
    return -torch.minimum(unclipped, clipped), active
