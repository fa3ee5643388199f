"""Group-normalised advantages (GRPO): ``A = (r - mean_g(r)) / (std_g(r) + eps)`` over each row of
``rewards``, one prompt's G completions. The *population* std (divide by G): the group is the whole
set compared, not a sample of a larger one (one correct of 8 -> +2.65 / -0.38). A group whose
rewards are all equal carries no signal and gets exactly 0, not rounding noise.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """``[num_groups, G]`` rewards -> ``[num_groups, G]`` advantages in the rewards' float dtype."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got {tuple(rewards.shape)}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    centred = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred)
