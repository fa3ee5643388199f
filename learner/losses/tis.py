"""Truncated importance sampling on PPO-clip, verl's ``tis_imp_ratio_cap`` (Yao et al., 2025):
``loss_t = -sg(min(exp(old_logp - behaviour_logp), eps_high)) * min(r A, clip(r) A)``, ``r =
exp(logp - old_logp)``. With one optimiser step per batch (driftrl's trainer) ``old_logp`` is
``logp.detach()``, r == 1 and the gradient is Ring-Zero's; a step-0 ``old_logp`` reused over several
steps also clips the drift since it. ``loss/clip_frac``: the share of truncated IS weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.losses import LossInputs, clean, finish, masked_mean
from learner.losses.ppo_clip import clipped_surrogate


def tis_loss(inp: LossInputs, eps_high: float = 2.0, eps_clip: float = 0.2) -> tuple[Tensor, dict[str, float]]:
    m, logp, behaviour_logp, adv = clean(inp)
    old = logp if inp.old_logp is None else inp.old_logp
    old = torch.where(m, old.to(logp.dtype), logp.new_zeros(())).detach()
    is_ratio = torch.exp(old - behaviour_logp)
    surrogate, _ = clipped_surrogate(torch.exp(logp - old), adv, eps_clip)
    per_token = is_ratio.clamp(max=eps_high) * surrogate
    stats = {"loss/clip_frac": masked_mean((is_ratio > eps_high).to(is_ratio.dtype), m)}
    return finish(per_token, m, logp, inp, stats)
