"""Start-up contract check: actor and learner must agree on what a log-prob is.

Before the first step, the actor's engine samples a fixed batch and reports behaviour log-probs;
the learner scores the same tokens with the same weights and its own precision policy. With equal
weights the ratio should be 1 up to numerics. If the mean absolute log-prob difference or the k3
mismatch exceeds the configured bound, the run refuses to start and names the sampling settings
that differ between the two sides (temperature, top-k, top-p, dtype) -- the usual culprit is a
temperature applied on one side only, which skews every ratio of the run.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

from core import messages as M
from learner.batching import collate
from learner.ratio_metrics import ratio_metrics


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float


class ContractError(RuntimeError):
    """Actor and learner disagree on log-probs of the same tokens with the same weights."""


def sample_fixed_batch(engine, task, n_prompts: int = 16, group_size: int = 4, seed: int = 4321):
    rng = random.Random(seed)
    problems = [task.sample(rng, "train") for _ in range(n_prompts)]
    prompts = [task.encode_prompt(p) for p in problems]
    samples = engine.generate([p for p in prompts for _ in range(group_size)])
    groups = []
    for i, prompt in enumerate(prompts):
        comps = [M.make_completion(s.tokens, s.logprobs, s.versions, s.finish_reason, 0.0)
                 for s in samples[i * group_size:(i + 1) * group_size]]
        groups.append(M.RolloutGroup(actor_id="contract", seq=i, group_id=f"contract-{i}", task=task.name,
                                     tier="default", prompt_tokens=np.asarray(prompt, dtype=M.TOKEN_DTYPE).tobytes(),
                                     completions=comps, start_version=0, created_at=0.0))
    return collate(groups, learner_version=0)


def check(trainer, engine, task, actor: Sampling, learner: Sampling, max_abs: float, max_k3: float) -> dict:
    """Score the engine's fixed batch with ``trainer``; raise ContractError if they disagree."""
    batch = sample_fixed_batch(engine, task)
    with torch.no_grad():
        logp, _ = trainer.logprobs(batch, sampling=learner)
    m = ratio_metrics(logp, batch.behaviour_logp, batch.mask)
    report = {"abs_logp_diff_mean": m["mismatch/abs_logp_diff_mean"], "kl_k3": m["mismatch/kl_k3"],
              "ratio_max": m["ratio/max"], "tokens": batch.num_tokens}
    if report["abs_logp_diff_mean"] > max_abs or report["kl_k3"] > max_k3:
        diffs = [f"{k}: actor={a} learner={b}" for k, a in asdict(actor).items()
                 if a != (b := asdict(learner)[k])]
        why = "; ".join(diffs) if diffs else (
            "sampling settings agree, so the numerics differ: compare actor.dtype with learner.body_dtype "
            "and the fp32_attn_softmax / fp32_head switches")
        raise ContractError(
            f"actor and learner disagree on log-probs of the same tokens with the same weights: "
            f"mean |dlogp| = {report['abs_logp_diff_mean']:.4g} (bound {max_abs}), "
            f"k3 = {report['kl_k3']:.4g} (bound {max_k3}). Differing settings: {why}")
    return report
