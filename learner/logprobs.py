"""The one place driftrl computes token log-probs (the ratio's numerator; ARCHITECTURE.md: Precision and the ratio).

Every loss, the start-up contract check and the metrics use :func:`token_logprobs`, so "the
learner's log-prob" means one thing. The LM head matmul and the log-softmax run in float32 by
default (``fp32=True``) whatever the body dtype: in bf16 a logit near 10 is only known to ~0.03,
and that error lands directly in ``log ρ``. ``fp32=False`` keeps ``hidden.dtype``, to measure it.
Rows go ``chunk`` at a time under activation checkpointing, so neither forward nor backward ever
holds more than ``chunk x V`` logits. The entropy (a metric, never differentiated) is computed
without a graph, after everything backward needs, so backward's recompute of a chunk stops before
it (checkpoint's early stop): over a 49k vocabulary it cost as much as the log-probs.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model.sampling import truncation_mask


def _chunk_logprobs(h: Tensor, w: Tensor, targets: Tensor, *, dtype: torch.dtype, temperature: float,
                    top_k: int, top_p: float, with_entropy: bool):
    logits = h.to(dtype) @ w.t()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0 or top_p < 1.0:
        keep = truncation_mask(logits, top_k, top_p)
        # The actor sampled the target from *its* support; the learner's weights have moved, so
        # its own truncated support may no longer contain it. Keeping the target in gives a
        # finite (small) log-prob -- a large honest log-ratio -- instead of -inf and NaN losses.
        keep.scatter_(-1, targets[:, None], True)
        logits = logits.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out_dtype = torch.promote_types(dtype, torch.float32)  # bf16 mode still returns float32
    logp = (logits.gather(-1, targets[:, None]).squeeze(-1) - lse).to(out_dtype)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        probs = torch.exp(logits - lse[:, None])
        # masked logits are -inf with probability 0: count them as 0, not 0 * -inf = NaN
        finite_logits = logits.masked_fill(torch.isinf(logits), 0.0)
        return logp, (lse - (probs * finite_logits).sum(dim=-1)).to(out_dtype)


def token_logprobs(hidden: Tensor, head_weight: Tensor, targets: Tensor, temperature: float = 1.0,
                   fp32: bool = True, chunk: int = 1024, with_entropy: bool = False, top_k: int = 0,
                   top_p: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy)`` of each target under ``softmax(hidden @ head_weight.T / temperature)`` (``hidden``: the
    final-normed states), renormalised over the actor's top-k/top-p support when those are on
    (:func:`truncation_mask`); float32 or wider, ``entropy`` (of that distribution, without a graph) None unless
    ``with_entropy``."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: "
                         "hidden must be targets.shape + (H,)")
    if head_weight.dim() != 2 or head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"head_weight must be [V, H={hidden.shape[-1]}], got {tuple(head_weight.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    dtype = torch.promote_types(hidden.dtype, torch.float32) if fp32 else hidden.dtype
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    w = head_weight.to(dtype)  # cast once, not per chunk ([V, H] is small next to [N, V])
    fn = partial(_chunk_logprobs, dtype=dtype, temperature=float(temperature), top_k=int(top_k),
                 top_p=float(top_p), with_entropy=with_entropy)
    needs_graph = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    outs = [checkpoint(fn, *args, use_reentrant=False) if needs_graph else fn(*args)
            for args in ((h[s : s + chunk], w, t[s : s + chunk]) for s in range(0, h.shape[0], chunk))]
    empty = torch.zeros(0, dtype=torch.promote_types(dtype, torch.float32), device=hidden.device)
    logp = torch.cat([o[0] for o in outs] or [empty]).reshape(targets.shape)
    if not with_entropy:
        return logp, None
    return logp, torch.cat([o[1] for o in outs] or [empty]).reshape(targets.shape)
