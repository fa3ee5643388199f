"""One optimiser step, split as ``forward_backward`` and ``optim_step`` (torchtitan style).

The numerator of the ratio is always recomputed here with the learner's current weights and
precision policy (DESIGN §4); the actor's log-probs are only the denominator.
"""

from __future__ import annotations

import math

import torch

from learner.advantages import group_advantages
from learner.batching import Batch
from learner.logprobs import token_logprobs
from learner.losses import LossInputs, make_loss
from learner.model import DTYPES, Qwen3, body_autocast
from learner.ratio_metrics import ratio_metrics


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient: the step is discarded before it reaches the optimiser."""


class Trainer:
    def __init__(self, cfg, model: Qwen3, ref: Qwen3 | None = None):
        self.cfg = cfg
        lc = cfg.learner
        self.model = model.float().train()
        self.model.fp32_attn_softmax = lc.fp32_attn_softmax
        self.ref = ref.float().eval().requires_grad_(False) if ref is not None else None
        if self.ref is not None:
            self.ref.fp32_attn_softmax = lc.fp32_attn_softmax
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, betas=tuple(lc.betas),
                                     weight_decay=lc.weight_decay)
        self.loss_fn = make_loss(lc.loss, eps_high=lc.eps_high, eps_clip=lc.eps_clip)
        # constant divisor of the token-level loss: the most tokens one step can hold
        self.token_divisor = float(lc.groups_per_step * cfg.actor.group_size * cfg.actor.max_new_tokens)
        self.skipped_nonfinite = 0

    def logprobs(self, batch: Batch, model: Qwen3 | None = None, with_entropy: bool = False, sampling=None):
        """Learner log-probs ``[N, L-1]`` of the completion tokens (zeros elsewhere).

        ``sampling`` (temperature, top_k, top_p) defaults to the actor's: the numerator must be
        taken under the same transformation the behaviour distribution was.
        """
        model = model or self.model
        lc = self.cfg.learner
        ac = sampling or self.cfg.actor
        ids = batch.ids
        pos = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
        with body_autocast(lc.body_dtype):
            hidden = model(ids[:, :-1], pos, batch.key_mask[:, :-1])
        sel = batch.mask > 0
        h = hidden[sel]
        if not lc.fp32_head:
            h = h.to(DTYPES[lc.body_dtype])
        lp, ent = token_logprobs(h, model.head_weight(), ids[:, 1:][sel], temperature=ac.temperature,
                                 fp32=lc.fp32_head, chunk=lc.logprob_chunk, with_entropy=with_entropy,
                                 top_k=ac.top_k, top_p=ac.top_p)
        full = torch.zeros(batch.mask.shape, dtype=lp.dtype).masked_scatter(sel, lp)
        return full, ent

    def forward_backward(self, batch: Batch) -> dict[str, float]:
        lc = self.cfg.learner
        logp, ent = self.logprobs(batch, with_entropy=True)
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp, _ = self.logprobs(batch, self.ref)
        adv = group_advantages(batch.rewards).reshape(-1)
        inp = LossInputs(logp=logp, behaviour_logp=batch.behaviour_logp, advantages=adv, mask=batch.mask,
                         norm=lc.norm, token_norm_divisor=self.token_divisor, ref_logp=ref_logp,
                         kl_beta=lc.kl_beta, kl_estimator=lc.kl_estimator)
        loss, metrics = self.loss_fn(inp)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"non-finite loss {loss.item()}")
        loss.backward()
        metrics.update(ratio_metrics(logp.detach(), batch.behaviour_logp, batch.mask, batch.staleness, lc.eps_high))
        metrics["learner/entropy"] = float(ent.mean().item()) if ent is not None and ent.numel() else math.nan
        return metrics

    def optim_step(self) -> float:
        """Clip and apply; a non-finite gradient is discarded (counted), never applied."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.learner.grad_clip or float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if not math.isfinite(norm):
            self.opt.zero_grad(set_to_none=True)
            self.skipped_nonfinite += 1
            raise NonFiniteError(f"non-finite gradient norm {norm}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def step(self, batch: Batch) -> dict[str, float]:
        try:
            metrics = self.forward_backward(batch)
            metrics["learner/grad_norm"] = self.optim_step()
        except NonFiniteError:
            self.opt.zero_grad(set_to_none=True)
            raise
        return metrics
