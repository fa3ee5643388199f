"""Truncated importance sampling on top of PPO-clip: the verl ``tis_imp_ratio_cap`` form from
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (Yao et al., 2025).

    w      = min(exp(old_logp - behaviour_logp), eps_high) detached: corrects actor/learner drift
    r      = exp(logp - old_logp)                          PPO ratio to the proximal policy
    loss_t = -w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)

``old_logp`` is the learner's own log-prob of the batch before this step's updates. With one
optimiser step per batch (driftrl's trainer) it is ``logp.detach()``: then r == 1, the PPO clip
never binds and the gradient is ``-min(rho, eps_high) * A * d logp`` -- the vanilla TIS policy
gradient, identical to Ring-Zero's. The two differ only when a trainer takes several steps on one
batch and passes the step-0 ``old_logp``: TIS then also applies PPO's trust region to the drift
*since* ``old_logp`` while Ring-Zero never zeroes a token.

Metrics: ``loss/clip_frac`` = fraction of response tokens whose IS weight was truncated
(exp(old_logp - behaviour_logp) > eps_high), i.e. rho > eps_high when old_logp is the current logp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.losses import LossInputs, clean, finish, masked_mean
from learner.losses.ppo_clip import clipped_surrogate


def tis_loss(inp: LossInputs, eps_high: float = 2.0, eps_clip: float = 0.2) -> tuple[Tensor, dict[str, float]]:
    if not eps_high > 0:
        raise ValueError(f"eps_high must be > 0, got {eps_high}")
    if not 0 < eps_clip < 1:
        raise ValueError(f"eps_clip must be in (0, 1), got {eps_clip}")
    c = clean(inp)
    if inp.old_logp is None:
        old = c.logp.detach()
    else:
        old = torch.where(c.m, inp.old_logp.to(c.logp.dtype), c.logp.new_zeros(())).detach()
    is_ratio = torch.exp(old - c.behaviour_logp)
    weight = is_ratio.clamp(max=eps_high)
    surrogate, _ = clipped_surrogate(torch.exp(c.logp - old), c.advantages, eps_clip)
    per_token = weight * surrogate
    stats = {"loss/clip_frac": masked_mean((is_ratio > eps_high).to(is_ratio.dtype), c.m)}
    return finish(per_token, c, inp, stats)
