"""Ring-Zero policy loss (ARCHITECTURE.md: Precision and the ratio): truncated importance weight, no clipping.
The gradient on every response token is ``-rho_hat * A * d logp`` with ``rho_hat > 0``: no token
is silently dropped the way PPO-clip drops tokens outside its trust region, while truncation at
``eps_high`` bounds the variance a rare learner-favoured token would inject.
``loss/clip_frac`` = fraction of response tokens with rho > eps_high (as learner.ratio_metrics).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.losses import LossInputs, clean, finish, masked_mean


def ring_zero_loss(inp: LossInputs, eps_high: float = 2.0) -> tuple[Tensor, dict[str, float]]:
    m, logp, behaviour_logp, adv = clean(inp)
    rho = torch.exp(logp.detach() - behaviour_logp)
    rho_hat = rho.clamp(max=eps_high)
    per_token = -rho_hat * adv * logp
    stats = {"loss/clip_frac": masked_mean((rho > eps_high).to(rho.dtype), m)}
    return finish(per_token, m, logp, inp, stats)
