"""The embedded PyTorch engine: batched sampling with a KV cache and in-flight weight updates.

Behaviour log-probs are those of the distribution actually sampled from
(``model.sampling.sampling_logprobs``, the rule the learner's numerator applies too).

Weights may change between two decode steps (:meth:`Engine.refresh_weights` runs before each);
every sampled token records the version of the weights whose logits produced it. The KV cache
of running sequences is kept across an update, as PipelineRL does: the prefix keys were computed by
older weights, which is exactly what the per-token versions describe.
"""

from __future__ import annotations

import torch

from actor.engines import Engine, Sample
from model.decoder import DTYPES, Qwen3
from model.kvcache import KVCache
from model.hf import load_pretrained
from model.sampling import SamplingSpec, sampling_logprobs
from model.tokenizer import Tokenizer


class TorchEngine(Engine):
    """Owns ``model`` from here on: it is cast to ``dtype`` and put in eval mode in place."""

    name = "torch"

    def __init__(self, model: Qwen3, spec: SamplingSpec, *, eos_ids, pad_id: int, max_new_tokens: int = 16,
                 dtype: str = "float32", seed: int = 0, weights=None):
        super().__init__(weights)
        self.model = model.to(DTYPES[dtype]).eval()
        self.model.fp32_attn_softmax = True
        self.dtype = DTYPES[dtype]
        self.spec = spec
        self.max_new_tokens = max_new_tokens
        self.eos_ids = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
        self.pad_id = pad_id
        self.gen = torch.Generator().manual_seed(seed)
        self._params = self.params()

    @classmethod
    def from_config(cls, actor_cfg, model_dir: str, weights=None, seed: int = 0) -> "TorchEngine":
        tok = Tokenizer.from_dir(model_dir)
        return cls(load_pretrained(model_dir), SamplingSpec.of(actor_cfg), eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                   max_new_tokens=actor_cfg.max_new_tokens, dtype=actor_cfg.dtype, seed=seed, weights=weights)

    def sampling(self) -> SamplingSpec:
        return self.spec

    def params(self) -> dict[str, torch.Tensor]:
        """The model's own Parameters and persistent buffers under their state_dict names: a
        weight transport copies into them or (shm, same dtype) rebinds their ``.data`` to shared
        memory, which detached state_dict() tensors would not pass on to the module."""
        own = dict(self.model.named_parameters(remove_duplicate=False))
        own |= dict(self.model.named_buffers(remove_duplicate=False))
        return {k: own[k] for k in self.model.state_dict()}

    def _apply_weights(self) -> int | None:
        return self.weights.apply(self._params)

    def _prefill_inputs(self, prompts: list[list[int]]):
        n, width = len(prompts), max(map(len, prompts))
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left-padded: every row's next token is at column -1
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = True
        return ids, (mask.long().cumsum(-1) - 1).clamp(min=0), mask

    def _next_token(self, hidden, greedy: bool):
        s = self.spec
        logp = sampling_logprobs(self.model.logits(hidden), s.temperature, s.top_k, s.top_p)
        nxt = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(-1)
        return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int | None = None,
                 greedy: bool = False) -> list[Sample]:
        n, budget = len(prompts), max_new_tokens or self.max_new_tokens
        ids, pos, mask = self._prefill_inputs(prompts)
        cache = KVCache(self.model.cfg, n, ids.shape[1] + budget, self.dtype)
        out_tok = torch.zeros(n, budget, dtype=torch.long)
        out_lp = torch.zeros(n, budget, dtype=torch.float32)
        out_ver = torch.zeros(n, budget, dtype=torch.int32)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), budget, dtype=torch.long)
        for t in range(budget):
            version = self.refresh_weights()
            nxt, lp = self._next_token(self.model(ids, pos, mask, cache)[:, -1], greedy)
            out_tok[:, t] = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            out_lp[:, t], out_ver[:, t] = lp, version
            finished_now = (~done) & torch.isin(nxt, self.eos_ids)
            lengths[finished_now] = t + 1
            done |= finished_now
            if bool(done.all()):
                break
            ids, pos = out_tok[:, t:t + 1], pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(n, 1, dtype=torch.bool)], dim=1)
        return [Sample(out_tok[i, :k].tolist(), out_lp[i, :k].tolist(), out_ver[i, :k].tolist(),
                       "stop" if bool(done[i]) else "length") for i, k in enumerate(lengths.tolist())]
