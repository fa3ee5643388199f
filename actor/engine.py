"""The embedded PyTorch engine: batched sampling with a KV cache and in-flight weight updates.

Behaviour log-probs are those of the distribution actually sampled from: logits / temperature,
then top-k / top-p truncation and renormalisation, all in FP32. The learner applies the same
transformation before its numerator (learner/logprobs.py), so the ratio compares like with like.

Weights may change between two decode steps (``before_step`` returns the version in effect);
every sampled token records the version of the weights whose logits produced it. The KV cache
of running sequences is kept across an update, as PipelineRL does: the prefix keys were computed by
older weights, which is exactly what the per-token versions describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from learner.logprobs import truncation_mask
from learner.model import DTYPES, KVCache, Qwen3


@dataclass
class Sample:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Log-probs (FP32) of the sampling distribution: temperature, then the learner's own top-k /
    top-p support rule (learner/logprobs.py), so both sides renormalise over the same tokens."""
    logits = logits.float() / temperature
    if top_k or top_p < 1.0:
        logits = logits.masked_fill(~truncation_mask(logits, top_k, top_p), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class TorchEngine:
    """Owns ``model`` from here on: it is cast to ``dtype`` and put in eval mode in place."""

    def __init__(self, model: Qwen3, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 max_new_tokens: int = 16, eos_id: int, pad_id: int, dtype: str = "float32", seed: int = 0):
        self.model = model.to(DTYPES[dtype]).eval()
        self.model.fp32_attn_softmax = True
        self.dtype = DTYPES[dtype]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.max_new_tokens = max_new_tokens
        self.eos_id, self.pad_id = eos_id, pad_id
        self.gen = torch.Generator().manual_seed(seed)

    def params(self) -> dict[str, torch.Tensor]:
        """The model's own Parameters and persistent buffers under their state_dict names: a
        weight transport copies into them or (shm, same dtype) rebinds their ``.data`` to shared
        memory, which detached state_dict() tensors would not pass on to the module."""
        own = dict(self.model.named_parameters(remove_duplicate=False))
        own |= dict(self.model.named_buffers(remove_duplicate=False))
        return {k: own[k] for k in self.model.state_dict()}

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], before_step: Callable[[], int] = lambda: 0,
                 max_new_tokens: int | None = None, greedy: bool = False) -> list[Sample]:
        n, budget = len(prompts), max_new_tokens or self.max_new_tokens
        width = max(map(len, prompts))
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = True
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = KVCache(self.model.cfg, n, width + budget, self.dtype)
        out_tok = torch.zeros(n, budget, dtype=torch.long)
        out_lp = torch.zeros(n, budget, dtype=torch.float32)
        out_ver = torch.zeros(n, budget, dtype=torch.int32)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), budget, dtype=torch.long)
        step_ids, step_pos = ids, pos
        for t in range(budget):
            version = before_step()
            hidden = self.model(step_ids, step_pos, mask, cache)[:, -1]
            logp = sampling_logprobs(self.model.logits(hidden), self.temperature, self.top_k, self.top_p)
            if greedy:
                nxt = logp.argmax(-1)
            else:
                nxt = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            out_tok[:, t] = nxt
            out_lp[:, t] = logp.gather(-1, nxt[:, None]).squeeze(-1)
            out_ver[:, t] = version
            finished_now = (~done) & (nxt == self.eos_id)
            lengths[finished_now] = t + 1
            done |= finished_now
            if bool(done.all()):
                break
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(n, 1, dtype=torch.bool)], dim=1)
        samples = []
        for i in range(n):
            k = int(lengths[i])
            samples.append(Sample(out_tok[i, :k].tolist(), out_lp[i, :k].tolist(), out_ver[i, :k].tolist(),
                                  "stop" if bool(done[i]) else "length"))
        return samples
