"""Start-up contract check: actor and learner must agree on what a log-prob is. The learner's backend
scores a fixed batch the actors' engine sampled, same weights (both passed in: no implementation is
imported); past the bounds the run refuses to start, naming the sampling settings that differ --
usually a temperature applied on one side only, which would skew every ratio of the run.
"""

from __future__ import annotations

import random
from dataclasses import asdict

import torch

from core import messages as M
from learner.batching import collate
from learner.ratio_metrics import ratio_metrics


class ContractError(RuntimeError):
    """Actor and learner disagree on log-probs of the same tokens with the same weights."""


def sample_fixed_batch(engine, task, n_prompts: int = 16, group_size: int = 4, seed: int = 4321,
                       max_new_tokens: int = 32):
    """The fixed batch both sides score; responses capped (uncapped, a 100M+ model took minutes to start)."""
    rng = random.Random(seed)
    prompts = [task.sample(rng, "train") for _ in range(n_prompts)]
    samples = engine.generate([list(p.tokens) for p in prompts for _ in range(group_size)],
                              max_new_tokens=min(max_new_tokens, getattr(engine, "max_new_tokens", max_new_tokens)))
    groups = [M.group_from_samples(samples[i * group_size:(i + 1) * group_size], [0.0] * group_size,
                                   actor_id="contract", seq=i, group_id=f"contract-{p.id}", task=task.name,
                                   tier=p.tier, prompt=p.tokens, start_version=0)
              for i, p in enumerate(prompts)]
    return collate(groups, learner_version=0)


def check(backend, engine, task, learner_sampling, max_abs: float, max_k3: float) -> dict:
    """Score ``engine``'s fixed batch with ``backend``; ContractError if they disagree."""
    actor = engine.sampling()
    batch = sample_fixed_batch(engine, task)
    with torch.no_grad():
        logp, _ = backend.logprobs(batch, sampling=learner_sampling)
    m = ratio_metrics(logp, batch.behaviour_logp, batch.mask)
    report = {"abs_logp_diff_mean": m["mismatch/abs_logp_diff_mean"], "kl_k3": m["mismatch/kl_k3"],
              "ratio_max": m["ratio/max"], "tokens": batch.num_tokens}
    if report["abs_logp_diff_mean"] > max_abs or report["kl_k3"] > max_k3:
        diffs = [f"{k}: actor={a} learner={b}" for k, a in asdict(actor).items()
                 if a != (b := asdict(learner_sampling)[k])]
        why = "; ".join(diffs) if diffs else (
            "sampling settings agree, so the numerics differ: compare actor.dtype with learner.body_dtype "
            "and the fp32_attn_softmax / fp32_head switches")
        raise ContractError(
            f"actor and learner disagree on log-probs of the same tokens with the same weights: "
            f"mean |dlogp| = {report['abs_logp_diff_mean']:.4g} (bound {max_abs}), "
            f"k3 = {report['kl_k3']:.4g} (bound {max_k3}). Differing settings: {why}")
    return report
