"""The sampler's rule (temperature, then top-k / top-p truncation, FP32), shared by the actor's engine
and the learner's numerator so that the two can never drift apart."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    @classmethod
    def of(cls, actor_cfg) -> "SamplingSpec":
        return cls(actor_cfg.temperature, actor_cfg.top_k, actor_cfg.top_p)


@torch.no_grad()
def truncation_mask(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Boolean ``[n, V]`` mask of the tokens a top-k / top-p sampler may draw from (HF ``generate``'s
    rules on temperature-scaled logits: top-k keeps ties of the k-th; top-p then keeps the smallest
    prefix of the top-k-renormalised distribution reaching ``top_p``, the top token always)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        keep &= logits >= logits.topk(top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        sorted_logits, order = logits.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True)
        probs = sorted_logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= torch.zeros_like(keep).scatter(-1, order, mass_before < top_p)
    return keep


def sampling_logprobs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Log-probs (FP32) of the sampling distribution: temperature, then the truncation rule."""
    logits = logits.float() / temperature
    if top_k or top_p < 1.0:
        logits = logits.masked_fill(~truncation_mask(logits, top_k, top_p), float("-inf"))
    return torch.log_softmax(logits, dim=-1)
