"""Policy losses: one pure function per file, ``(LossInputs, params) -> (loss, metrics)``.

Shared here: the input struct, masking, the two normalisations and the KL-to-reference term, so
each loss file holds only its per-token formula. The trainer picks a loss once with
:func:`make_loss` (no string branches scattered over the trainer).

Normalisation (ARCHITECTURE.md: Precision and the ratio):

* ``"token"`` -- sum of per-token terms over all response tokens, divided by a **constant**
  ``token_norm_divisor``. The trainer passes ``groups_per_step * group_size * max_new_tokens``:
  every token then carries the same weight whatever else is in the batch, so a longer correct
  answer gets proportionally more gradient (a per-batch ``mask.sum()`` divisor would shrink every
  token's weight whenever the batch happens to hold long answers), and micro-batch gradients
  simply add up to the full-batch gradient. Default when None: ``mask.sum()`` of this call.
* ``"sample"`` -- each sample's token sum divided by its own length, then the mean over the
  ``B`` rows of this call. When micro-batching, split by whole samples and scale each
  micro-batch loss by ``B_micro / B_step``.

Metrics use the names of ARCHITECTURE.md (Metric vocabulary): ``learner/loss``, ``learner/kl_ref`` (masked token mean of the
chosen estimator, present when ``ref_logp`` is given) and ``loss/clip_frac`` (the loss's own
clipped/truncated token fraction; see each loss), never a ``ratio/*`` name, which
learner/ratio_metrics.py owns.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from core.registry import resolve
from learner.kl import ESTIMATORS, kl_per_token

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
            raise ValueError(
                f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(self.advantages.shape)}"
            )
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.token_norm_divisor is not None and not self.token_norm_divisor > 0:
            raise ValueError(f"token_norm_divisor must be > 0, got {self.token_norm_divisor}")
        if self.kl_estimator not in ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {sorted(ESTIMATORS)}, got {self.kl_estimator!r}")


@dataclass
class Clean:
    """Inputs with every non-response position zeroed, so no inf/NaN there can reach the loss or
    its gradient (``where(mask, f(x), 0)`` alone still back-propagates ``0 * inf = NaN``)."""

    m: Tensor  # bool response mask
    logp: Tensor
    behaviour_logp: Tensor
    advantages: Tensor  # broadcast to [B, T]


def clean(inp: LossInputs) -> Clean:
    m = inp.mask > 0
    adv = inp.advantages if inp.advantages.dim() == 2 else inp.advantages[:, None].expand_as(m)
    zero = inp.logp.new_zeros(())
    return Clean(
        m=m,
        logp=torch.where(m, inp.logp, zero),
        behaviour_logp=torch.where(m, inp.behaviour_logp.to(inp.logp.dtype), zero),
        advantages=torch.where(m, adv.to(inp.logp.dtype), zero),
    )


def normalise(per_token: Tensor, m: Tensor, inp: LossInputs) -> Tensor:
    """Reduce masked per-token terms to a scalar with the ``token`` or ``sample`` rule."""
    per_token = torch.where(m, per_token, per_token.new_zeros(()))
    if inp.norm == "token":
        divisor = inp.token_norm_divisor
        if divisor is None:
            divisor = m.sum().clamp(min=1).to(per_token.dtype)
        return per_token.sum() / divisor
    lengths = m.sum(dim=1).clamp(min=1).to(per_token.dtype)
    return (per_token.sum(dim=1) / lengths).mean()


def masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, x.new_zeros(())).sum() / m.sum().clamp(min=1)


def finish(pg_token: Tensor, c: Clean, inp: LossInputs, stats: dict[str, Tensor]):
    """Add the KL term, normalise, and turn ``stats`` into floats with one device sync."""
    per_token = pg_token
    if inp.ref_logp is not None:
        ref = torch.where(c.m, inp.ref_logp.to(c.logp.dtype), c.logp.new_zeros(()))
        kl = kl_per_token(c.logp, ref, inp.kl_estimator)
        stats["learner/kl_ref"] = masked_mean(kl.detach(), c.m)
        if inp.kl_beta:
            per_token = per_token + inp.kl_beta * kl
    loss = normalise(per_token, c.m, inp)
    stats["learner/loss"] = loss.detach()
    keys = list(stats)
    values = torch.stack([stats[k].to(torch.float64) for k in keys]).tolist()
    return loss, dict(zip(keys, values))


LossFn = Callable[[LossInputs], "tuple[Tensor, dict[str, float]]"]


# learner.loss -> "module:function"; a loss's parameters are the learner.* fields it names
LOSSES = {"ring_zero": "learner.losses.ring_zero:ring_zero_loss", "ppo_clip": "learner.losses.ppo_clip:ppo_clip_loss",
          "tis": "learner.losses.tis:tis_loss"}


def make_loss(name: str, **params) -> LossFn:
    """The loss registered as ``name`` (``learner.loss``) with the ``params`` its function names
    bound by name (e.g. ``eps_high``, ``eps_clip``: pass every learner field, each takes its own)."""
    fn = resolve(LOSSES, name, "loss")
    wanted = inspect.signature(fn).parameters
    return partial(fn, **{k: v for k, v in params.items() if k in wanted})
