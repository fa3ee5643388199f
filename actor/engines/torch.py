"""The embedded PyTorch engine: continuous batching over a preallocated KV cache, with in-flight
weight updates.

Scheduling. Up to ``max_batch`` sequences decode at once, one per slot of the engine's
:class:`model.kvcache.KVCache`. Each loop turn runs one forward, then retires what finished:

- prompts waiting and slots free: the newly admitted prompts are prefilled together, in one
  forward over just their slots (right-padded; the cache records each row's real length, so the
  padding is overwritten by the row's next token), and sample their first token;
- otherwise a decode step: one token for every running sequence, each at its own position.

A finished sequence's slot goes to the next waiting prompt at once; the running sequences do not
wait for the batch's longest member. When nothing waits, the last running sequence moves into
the hole (one copy of its K/V), so the running rows stay packed at the front of the cache and a
decode step reads it as a view: finished rows cost nothing more, and no step gathers K/V.

Each sequence has its own token budget (``max_new_tokens``, one per prompt or one for all) and
finishes "length" when it reaches it.

The cache is allocated once per engine and grown geometrically (slots up to ``max_batch``,
positions to the longest prompt plus its budget) when a call needs more than it holds;
it is kept between calls, so an actor's steady state allocates nothing per call.

Streaming: :meth:`TorchEngine.stream` yields ``(index, Sample)`` the moment a sequence finishes,
so the worker can send a group as soon as its last sample is done; :meth:`generate` collects it.

Behaviour log-probs are those of the distribution actually sampled from
(``model.sampling.sampling_logprobs``, the rule the learner's numerator applies too).

Weights may change between two forwards (:meth:`Engine.refresh_weights` runs before each, prefill
or decode); every sampled token records the version of the weights whose logits produced it. The
KV cache of running sequences is kept across an update, as PipelineRL does: the prefix keys were
computed by older weights, which is exactly what the per-token versions describe.

Speed: ``bench/engine.py`` compares this engine with ``transformers``' ``generate`` on the same
checkpoint, prompts, batch, sampling and threads; its docstring has the figures.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from actor.engines import Engine, EngineStopped, Sample, budgets
from core import placement, precision
from model.attention import DTYPES
from model.hf import load_pretrained
from model.kvcache import KVCache
from model.sampling import SamplingSpec, sampling_logprobs
from model.tokenizer import Tokenizer

# Positions grow by a quarter, slots double (up to max_batch): prompt lengths vary a little from
# call to call, and doubling every slot's positions for a few more tokens would double the cache
# (3 GB at the 135M shape for 64 slots x 1,024 positions); reallocating is only a memset.
POSITIONS_GROWTH = 1.25
DRAW_CHUNK = 256  # entries per chunk of the sampler's two-level inverse CDF


@dataclass
class _Seq:
    """One prompt's sequence: its token budget, what it has produced so far, and why it stopped
    (once it has)."""

    index: int
    prompt: list[int]
    budget: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None

    def sample(self) -> Sample:
        return Sample(self.tokens, self.logprobs, self.versions, self.finish)


def _grown(need: int, have: int, factor: float, cap: int | None = None) -> int:
    """``have`` if it is enough, else geometric growth: ``have * factor`` (at most ``cap``) or
    ``need``, whichever is larger."""
    if need <= have:
        return have
    grown = math.ceil(have * factor)
    return max(need, grown if cap is None else min(grown, cap))


def _chunk_sums(probs, c: int):
    """FP64 sums of each row's consecutive ``c``-entry chunks ``[B, ceil(V / c)]`` (last: the rest)."""
    full = probs.shape[-1] // c * c
    parts = [probs[:, :full].unfold(-1, c, c).sum(-1, dtype=torch.float64)] if full else []
    if full < probs.shape[-1]:
        parts.append(probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _inverse_cdf(probs, uniform):
    """Row ``b``'s token: the first whose cumulative probability exceeds ``uniform[b]`` x the row's
    total, without a cumulative sum over the whole vocabulary. First the chunk (CDF of FP64 chunk
    sums), then the entry inside it (FP64 cumsum of ``DRAW_CHUNK`` entries). Measured at batch
    32 x vocab 49152 with the logits out of cache (1 thread, exp included): 4-8 ms, against 25
    for one FP64 cumsum over the vocabulary and 41-53 for ``torch.multinomial`` (it draws an
    exponential per entry) -- out of a ~370 ms decode step of the 135M shape at that batch.
    ``u`` stays below the total and the result is clamped to the chunk's last positive entry, so
    a zero-probability token (outside top-k / top-p) is never drawn, whatever the rounding."""
    c, vocab = DRAW_CHUNK, probs.shape[-1]
    cdf = _chunk_sums(probs, c).cumsum(-1)
    total = cdf[:, -1:]
    u = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(cdf, u, right=True)  # [B, 1]: its cumulative sum is the first above u
    before = torch.where(chunk > 0, cdf.gather(-1, (chunk - 1).clamp(min=0)), torch.zeros_like(u))
    idx = chunk * c + torch.arange(c, device=probs.device)
    inner = probs.gather(-1, idx.clamp(max=vocab - 1)).masked_fill(idx >= vocab, 0).cumsum(-1, dtype=torch.float64)
    k = torch.searchsorted(inner, u - before, right=True)
    last_positive = (inner < inner[:, -1:]).sum(-1, keepdim=True)
    return (chunk * c + torch.minimum(k, last_positive)).squeeze(-1)


def _pack(cache: KVCache, running: list[_Seq | None]) -> None:
    """Fill every hole with the last running sequence, so the running rows are slots [0, m)."""
    while None in running:
        if running[-1] is None:
            running.pop()
            continue
        hole = running.index(None)
        cache.move(len(running) - 1, hole)
        running[hole] = running.pop()


class TorchEngine(Engine):
    """Owns ``model`` from here on: it is cast to ``dtype``, moved to ``device`` and put in eval
    mode in place; the KV cache, every per-step tensor and the sampling generator live on
    ``device`` too (on CUDA a host round trip per token would cost more than the step)."""

    name = "torch"

    def __init__(self, model, spec: SamplingSpec, *, eos_ids, pad_id: int, max_new_tokens: int = 16,
                 max_batch: int = 256, dtype: str = "bfloat16", fp32_attn_softmax: bool = True, seed: int = 0,
                 weights=None, device="cpu"):
        super().__init__(weights)
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (sequences decoded at once), got {max_batch}")
        self.device = torch.device(device)
        self.dtype = DTYPES[precision.dtype_name(dtype, self.device)]
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.fp32_attn_softmax = fp32_attn_softmax
        self.spec = spec
        self.max_new_tokens = max_new_tokens
        self.max_batch = max_batch
        self.eos_ids = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.pad_id = pad_id
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self._params = self.params()
        self._cache: KVCache | None = None

    @classmethod
    def from_config(cls, actor_cfg, model_dir: str, weights=None, seed: int = 0) -> "TorchEngine":
        """``actor_cfg.device``: the worker passes its own resolved device; a list or ``auto``
        (the launcher's contract check) is resolved as for actor 0 (core/placement.py)."""
        tok = Tokenizer.from_dir(model_dir)
        device = placement.resolve_actor(actor_cfg, 0, placement.visible_gpus())
        return cls(load_pretrained(model_dir), SamplingSpec.of(actor_cfg), eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                   max_new_tokens=actor_cfg.max_new_tokens, max_batch=actor_cfg.max_batch, dtype=actor_cfg.dtype,
                   fp32_attn_softmax=actor_cfg.fp32_attn_softmax, seed=seed, weights=weights, device=device)

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

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int] | None = None,
               greedy: bool = False) -> Iterator[tuple[int, Sample]]:
        """Continuous batching (module docstring): each turn admits waiting prompts into free
        slots and prefills them, or decodes one token for every running sequence; then yields
        what finished."""
        limits = budgets(max_new_tokens, len(prompts), self.max_new_tokens)
        if not prompts:
            return
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: a sequence needs at least one token to condition on")
        longest = max(len(p) + b for p, b in zip(prompts, limits))
        cache = self._cache_for(min(self.max_batch, len(prompts)), longest)
        waiting = deque(_Seq(i, list(p), b) for i, (p, b) in enumerate(zip(prompts, limits)))
        running: list[_Seq | None] = []  # running[i] lives in cache slot i
        while True:
            if self.stop is not None and self.stop.is_set():
                raise EngineStopped("stopped mid-generation")
            if self.on_step is not None:
                self.on_step()
            fresh = self._admit(cache, running, waiting)
            if not running:
                return
            if fresh:
                self._prefill(cache, running, fresh, greedy)
            else:
                self._decode(cache, running, greedy)
            for slot, seq in enumerate(running):
                if seq.finish:
                    running[slot] = None
                    yield seq.index, seq.sample()

    def _cache_for(self, slots: int, max_len: int) -> KVCache:
        """The engine's one cache, grown (and reallocated: nothing runs between calls) if needed."""
        if self._cache is None or not self._cache.fits(slots, max_len):
            have = (self._cache.slots, self._cache.max_len) if self._cache is not None else (0, 0)
            self._cache = None  # free the old buffers before the new ones: peak memory is one cache
            self._cache = KVCache(self.model.cfg, _grown(slots, have[0], 2, self.max_batch),
                                  _grown(max_len, have[1], POSITIONS_GROWTH), self.dtype, device=self.device)
        self._cache.reset(slice(None))
        return self._cache

    def _admit(self, cache: KVCache, running: list[_Seq | None], waiting: deque) -> list[int]:
        """Give free slots to waiting prompts, holes first; pack the rest. Returns the new slots."""
        fresh = []
        for slot in range(min(self.max_batch, cache.slots)):
            if not waiting:
                break
            if slot == len(running):
                running.append(None)
            if running[slot] is None:
                running[slot] = waiting.popleft()
                fresh.append(slot)
        _pack(cache, running)
        return fresh

    def _prefill(self, cache: KVCache, running: list[_Seq], fresh: list[int], greedy: bool) -> None:
        """One forward over the newly admitted slots only, right-padded; samples each first token."""
        seqs = [running[i] for i in fresh]
        lens = torch.tensor([len(s.prompt) for s in seqs])
        ids = torch.full((len(seqs), int(lens.max())), self.pad_id, dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : len(s.prompt)] = torch.tensor(s.prompt, dtype=torch.long)
        ids, lens = ids.to(self.device), lens.to(self.device)  # built on the host, one copy each
        cols = torch.arange(ids.shape[1], device=self.device)
        rows = torch.tensor(fresh, device=self.device)
        cache.reset(rows)
        cache.bind(rows, lens)
        version = self.refresh_weights()
        hidden = self.model(ids, cols.expand_as(ids), cols[None] < lens[:, None], cache)
        self._record(seqs, hidden[torch.arange(len(seqs), device=self.device), lens - 1], version, greedy)

    def _decode(self, cache: KVCache, running: list[_Seq], greedy: bool) -> None:
        """One token for every running sequence (slots [0, m)), each at its own position."""
        pos = cache.lengths[: len(running), None].clone()  # the pending token's position
        ids = torch.tensor([[s.tokens[-1]] for s in running], dtype=torch.long, device=self.device)
        mask = torch.arange(int(pos.max()) + 1, device=self.device)[None] <= pos
        version = self.refresh_weights()
        hidden = self.model(ids, pos, mask, cache)
        self._record(running, hidden[:, -1], version, greedy)

    def _record(self, seqs: list[_Seq], hidden, version: int, greedy: bool) -> None:
        nxt, lp = self._next_token(hidden, greedy)
        stops = torch.isin(nxt, self.eos_ids).tolist()
        for seq, tok, logp, stop in zip(seqs, nxt.tolist(), lp.tolist(), stops):
            seq.tokens.append(tok)
            seq.logprobs.append(logp)
            seq.versions.append(version)
            if stop or len(seq.tokens) >= seq.budget:
                seq.finish = "stop" if stop else "length"

    def _next_token(self, hidden, greedy: bool):
        s = self.spec
        logp = sampling_logprobs(self.model.logits(hidden), s.temperature, s.top_k, s.top_p)
        nxt = logp.argmax(-1) if greedy else self._draw(logp)
        return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)

    def _draw(self, logp):
        """One token per row from ``exp(logp)`` by a two-level inverse CDF (:func:`_inverse_cdf`)
        with one FP64 uniform per row from the engine's seeded generator."""
        probs = logp.exp()
        uniform = torch.rand(probs.shape[0], 1, generator=self.gen, dtype=torch.float64, device=self.device)
        return _inverse_cdf(probs, uniform)
