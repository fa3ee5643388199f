"""Policy losses: one pure function per file, ``(LossInputs, params) -> (loss, metrics)``; shared
here: the inputs, masking, the two normalisations and the KL-to-reference term. Metrics:
``learner/loss``, ``learner/kl_ref``, ``loss/clip_frac`` (each loss's own), never a ``ratio/*`` name.
``"token"``: the per-token sum over a **constant** ``token_norm_divisor`` (the trainer's ``groups_per_step *
group_size * max_new_tokens``; None: ``mask.sum()``), so every token weighs the same whatever else is in the
batch; ``"sample"``: each row's mean over its own length, then the mean over rows (how micro-batches add up to
the step's gradient under either: ARCHITECTURE.md, Precision and the ratio).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from core.registry import resolve

NORMS = ("token", "sample")


@dataclass
class LossInputs:
    logp: Tensor  # [B, T] learner log-probs (with grad), from learner.logprobs.token_logprobs
    behaviour_logp: Tensor  # [B, T] actor log-probs (the ratio's denominator)
    advantages: Tensor  # [B] per sample or [B, T] per token
    mask: Tensor  # [B, T] float, 1 = response token; other positions may hold any garbage
    norm: str = "token"
    token_norm_divisor: float | None = None  # see module docstring; None = mask.sum()
    ref_logp: Tensor | None = None  # [B, T] frozen reference log-probs; enables the KL term
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    old_logp: Tensor | None = None  # [B, T] proximal policy (TIS only); None = logp.detach()

    def __post_init__(self):
        if self.logp.dim() != 2:
            raise ValueError(f"logp must be [B, T], got {tuple(self.logp.shape)}")
        shape = self.logp.shape
        for name in ("behaviour_logp", "mask", "ref_logp", "old_logp"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} must match logp {tuple(shape)}, got {tuple(t.shape)}")
        if self.advantages.shape not in (shape[:1], shape):
            raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape)}, "
                             f"got {tuple(self.advantages.shape)}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.token_norm_divisor is not None and not self.token_norm_divisor > 0:
            raise ValueError(f"token_norm_divisor must be > 0, got {self.token_norm_divisor}")


def clean(inp: LossInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(m, logp, behaviour_logp, advantages)``: the bool response mask and the inputs with every
    other position zeroed, advantages broadcast to ``[B, T]``. No inf/NaN there can then reach the
    loss or its gradient (``where(mask, f(x), 0)`` alone still back-propagates ``0 * inf = NaN``)."""
    m = inp.mask > 0
    adv = inp.advantages if inp.advantages.dim() == 2 else inp.advantages[:, None].expand_as(m)
    zero, dtype = inp.logp.new_zeros(()), inp.logp.dtype
    return (m, torch.where(m, inp.logp, zero), torch.where(m, inp.behaviour_logp.to(dtype), zero),
            torch.where(m, adv.to(dtype), zero))


def masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, x.new_zeros(())).sum() / m.sum().clamp(min=1)


def kl_per_token(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(p || q) from tokens sampled from p (Schulman 2020), ``log r = ref_logp
    - logp``: k1 = -log r (unbiased, high variance), k2 = (log r)^2 / 2 (biased, >= 0), k3 = r - 1 -
    log r (unbiased, >= 0; expm1 keeps r - 1 exact for a tiny log r)."""
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def finish(pg_token: Tensor, m: Tensor, logp: Tensor, inp: LossInputs, stats: dict[str, Tensor]):
    """Add the KL term, normalise, and turn ``stats`` into floats with one device sync."""
    if inp.ref_logp is not None:
        ref = torch.where(m, inp.ref_logp.to(logp.dtype), logp.new_zeros(()))
        kl = kl_per_token(logp, ref, inp.kl_estimator)
        stats["learner/kl_ref"] = masked_mean(kl.detach(), m)
        if inp.kl_beta:
            pg_token = pg_token + inp.kl_beta * kl
    pg_token = torch.where(m, pg_token, pg_token.new_zeros(()))
    if inp.norm == "token":
        loss = pg_token.sum() / (inp.token_norm_divisor or m.sum().clamp(min=1).to(pg_token.dtype))
    else:
        loss = (pg_token.sum(dim=1) / m.sum(dim=1).clamp(min=1).to(pg_token.dtype)).mean()
    stats["learner/loss"] = loss.detach()
    return loss, dict(zip(stats, torch.stack([v.to(torch.float64) for v in stats.values()]).tolist()))


# learner.loss -> "module:function"; a loss's parameters are the learner.* fields it names
LOSSES = {"ring_zero": "learner.losses.ring_zero:ring_zero_loss", "ppo_clip": "learner.losses.ppo_clip:ppo_clip_loss",
          "tis": "learner.losses.tis:tis_loss"}


def make_loss(name: str, **params) -> Callable[[LossInputs], tuple[Tensor, dict[str, float]]]:
    """The loss ``name`` with the ``params`` its function names bound (pass every learner field)."""
    fn = resolve(LOSSES, name, "loss")
    wanted = inspect.signature(fn).parameters
    return partial(fn, **{k: v for k, v in params.items() if k in wanted})
