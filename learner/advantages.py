"""Group-normalised advantages (GRPO-style, ARCHITECTURE.md: Precision and the ratio).

Each row of ``rewards`` is one prompt's group of G completions:

    A = (r - mean_g(r)) / (std_g(r) + eps)      (std_norm=True)
    A =  r - mean_g(r)                          (std_norm=False, "Dr. GRPO": no difficulty bias)

std is the *population* std (divide by G, not G - 1): the group is the whole set being compared,
not a sample of a larger one, and it keeps a binary-reward group's advantages at +-1-scale
(e.g. one correct out of 8 -> +2.65 / -0.38) independent of Bessel's correction. Groups whose
rewards are all equal carry no learning signal and get exactly 0 (not rounding noise / eps).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-6, std_norm: bool = True) -> Tensor:
    """``[num_groups, G]`` rewards -> ``[num_groups, G]`` advantages in the rewards' float dtype."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got {tuple(rewards.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    centred = r - r.mean(dim=1, keepdim=True)
    if std_norm:
        centred = centred / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred)
