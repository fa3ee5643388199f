"""The embedded PyTorch engine: continuous batching over a preallocated KV cache (ARCHITECTURE.md, Seams).
Running sequences are packed at the front of the cache, so a decode step reads it as a view; they keep their
KV cache across a weight update (as PipelineRL).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from actor.engines import Engine, EngineStopped, Sample
from core import placement, precision
from model.attention import DTYPES
from model.hf import load_pretrained
from model.kvcache import KVCache
from model.sampling import SamplingSpec, sampling_logprobs
from model.tokenizer import Tokenizer

# positions grow by a quarter, slots double: doubling positions for a few more tokens would double
# the cache (3 GB at the 135M shape for 64 slots x 1,024 positions)
POSITIONS_GROWTH = 1.25
DRAW_CHUNK = 256  # entries per chunk of the sampler's two-level inverse CDF
PACK_ROWS = 32  # the rows a packed weight's layout is tuned for (it serves any count)


def _layout(w: torch.Tensor):
    """``w`` laid out once for oneDNN's matmul kernel (tuned for PACK_ROWS rows; it serves any count)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)


def _packed_matmul(x, packed, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class _PackedLinear:
    """A BF16 ``nn.Linear``'s forward on a oneDNN copy of its weight laid out for the CPU's matmul kernel once,
    instead of on every call: a decode step's matmuls are small (a row per sequence) and that layout pass was
    about half of each (1.7-2x at 8-128 rows, same numbers). Laid out again when the weight changes: on each
    version the engine applies (``key`` cleared: a transport's preadv writes past the version counter), at
    a new address, or on an in-place write its version counter sees."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear, self.key, self.packed = linear, None, None

    def __call__(self, x):
        w = self.linear.weight
        if self.key != (key := (w.data_ptr(), w._version)):
            self.packed, self.key = _layout(w), key
        return _packed_matmul(x, self.packed, self.linear.bias)


def _onednn(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def _pack_linears(model) -> list[_PackedLinear]:
    """Packed forwards for every linear of ``model``: the engine asks for them for a BF16 body on a CPU where
    oneDNN computes BF16 (FP32 ones gain little or lose at decode sizes)."""
    packed = [_PackedLinear(m) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for p in packed:
        p.linear.forward = p
    return packed


@dataclass
class _Seq:
    index: int
    prompt: list[int]
    budget: int
    out: Sample  # finish_reason "" while running
    feed: int = -1  # the token the next decode step reads: the last sampled one, or a shared prompt's last


def _grown(need: int, have: int, factor: float, cap: int | None = None) -> int:
    return have if need <= have else max(need, min(math.ceil(have * factor), math.inf if cap is None else cap))


def _inverse_cdf(probs, uniform):
    """Row ``b``'s token: the first whose cumulative probability exceeds ``uniform[b]`` x the row's
    total, found chunk first, then inside the chunk: ~2 ms at batch 32 x vocab 49152 against 25 for
    one FP64 cumsum and 41-53 for ``torch.multinomial`` (measured). Each chunk is summed in FP32 (to
    ~1e-7 of itself; summed in FP64 it took a [B, V] FP64 copy, 34 ms a step in SmolLM2's engine),
    the sums accumulate in FP64. Clamped to the chunk's last positive entry, so a truncated-away
    token is never drawn, whatever the rounding."""
    c, vocab = DRAW_CHUNK, probs.shape[-1]
    full = vocab // c * c  # sums of each row's c-entry chunks [B, ceil(V / c)], the last: the rest
    parts = [probs[:, :full].unfold(-1, c, c).sum(-1).double()] if full else []
    if full < vocab:
        parts.append(probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64))
    cdf = (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]).cumsum(-1)
    total = cdf[:, -1:]
    u = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(cdf, u, right=True)  # [B, 1]: its cumulative sum is the first above u
    before = torch.where(chunk > 0, cdf.gather(-1, (chunk - 1).clamp(min=0)), torch.zeros_like(u))
    idx = chunk * c + torch.arange(c, device=probs.device)
    inner = probs.gather(-1, idx.clamp(max=vocab - 1)).masked_fill(idx >= vocab, 0).cumsum(-1, dtype=torch.float64)
    k = torch.searchsorted(inner, u - before, right=True)
    last_positive = (inner < inner[:, -1:]).sum(-1, keepdim=True)
    return (chunk * c + torch.minimum(k, last_positive)).squeeze(-1)


class TorchEngine(Engine):
    """Owns ``model`` (cast, moved and put in eval mode in place); the cache, the per-step tensors and
    the generator live on ``device`` too (a host round trip per token costs more than the step)."""

    name = "torch"
    supports_prefixes = True

    def __init__(self, model, spec: SamplingSpec, *, eos_ids, pad_id: int, max_new_tokens: int = 16,
                 max_batch: int = 256, dtype: str = "bfloat16", fp32_attn_softmax: bool = True, seed: int = 0,
                 weights=None, device="cpu"):
        super().__init__(weights)
        self.device = torch.device(device)
        self.dtype = DTYPES[precision.dtype_name(dtype, self.device)]
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.fp32_attn_softmax = fp32_attn_softmax
        bf16 = self.dtype == torch.bfloat16 and _onednn(self.device) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self._packed = _pack_linears(self.model) if bf16 else []
        self.spec, self.max_new_tokens, self.max_batch, self.pad_id = spec, max_new_tokens, max_batch, pad_id
        self.eos_ids = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self._params = self.params()
        self._head32: tuple | None = None  # (the weight's address, its FP32 copy, that copy packed or None)
        self._cache: KVCache | None = None
        self._running: list[_Seq | None] = []  # the current stream's slots (progress)

    @classmethod
    def from_config(cls, actor_cfg, model_dir: str, weights=None, seed: int = 0) -> "TorchEngine":
        """``actor_cfg.device``: the worker's resolved one; a list or ``auto`` is resolved as actor 0's."""
        tok = Tokenizer.from_dir(model_dir)
        device = placement.resolve_actor(actor_cfg, 0, placement.visible_gpus())
        return cls(load_pretrained(model_dir), SamplingSpec.of(actor_cfg), eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                   max_new_tokens=actor_cfg.max_new_tokens, max_batch=actor_cfg.max_batch, dtype=actor_cfg.dtype,
                   fp32_attn_softmax=actor_cfg.fp32_attn_softmax, seed=seed, weights=weights, device=device)

    def params(self) -> dict[str, torch.Tensor]:
        """The model's own Parameters and buffers by state_dict name: a transport copies into them or
        rebinds their ``.data`` (shm), which detached state_dict() tensors would not pass on."""
        own = dict(self.model.named_parameters(remove_duplicate=False))
        own |= dict(self.model.named_buffers(remove_duplicate=False))
        return {k: own[k] for k in self.model.state_dict()}

    def _apply_weights(self) -> int | None:
        applied = self.weights.apply(self._params)
        if applied is not None:
            self._head32 = None
            for p in self._packed:  # a transport's read may bypass the version counter (preadv into the tensor)
                p.key = None
        return applied

    def _logits(self, hidden) -> torch.Tensor:
        """FP32 logits: the head's weight converted to FP32 once per weight version, not once per token (for
        a BF16 body that conversion was 39 % of SmolLM2's generate), and on a CPU laid out for oneDNN's matmul
        (1.3-2.4x at 8-32 rows over a 49k vocabulary; the same sums, in another order)."""
        w = self.model.head_weight()
        if self._head32 is None or self._head32[0] != w.data_ptr():
            w32 = w.float()
            packed = _layout(w32) if _onednn(self.device) else None
            self._head32 = (w.data_ptr(), w32, packed)
        _, w32, packed = self._head32
        if packed is None:
            return self.model.logits(hidden, w32)
        return _packed_matmul(hidden.float(), packed)

    @torch.inference_mode()
    def _stream(self, prompts: list[list[int]], limits: list[int], greedy: bool,
                prefixes: list[Sample | None] | None = None) -> Iterator[tuple[int, Sample]]:
        longest = max(len(p) + b for p, b in zip(prompts, limits))
        cache = self._cache_for(min(self.max_batch, len(prompts)), longest)
        # a saved prefix is prefilled with the prompt; the next token is sampled after it
        outs = [Sample([], [], []) if q is None else q.copy("") for q in prefixes or [None] * len(prompts)]
        waiting = deque(_Seq(i, list(prompts[i]) + o.tokens, limits[i], o) for i, o in enumerate(outs))
        self._running = running = []  # running[i] lives in cache slot i
        while True:
            if self.stop is not None and self.stop.is_set():
                raise EngineStopped("stopped mid-generation")
            if self.on_step is not None:
                self.on_step()
            fresh = self._admit(cache, running, waiting)
            if not running:
                return
            leads, shares = self._share_prompts(running, fresh) if fresh else ([], [])
            if leads:  # the copies take their K/V once the leads are prefilled
                self._prefill(cache, running, leads, greedy, shares)
            else:
                self._take_shares(cache, running, shares)
                self._decode(cache, running, greedy)
            for slot, seq in enumerate(running):
                if seq.out.finish_reason:
                    running[slot] = None
                    yield seq.index, seq.out

    def _progress(self) -> dict[int, Sample]:
        return {s.index: s.out for s in self._running if s is not None and s.out.tokens and not s.out.finish_reason}

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
        """Give free slots to waiting prompts, holes first, then fill every hole left with the last
        running sequence, so the running rows are slots [0, m). Returns the new slots."""
        fresh = []
        for slot in range(min(self.max_batch, cache.slots)):
            if not waiting:
                break
            if slot == len(running):
                running.append(None)
            if running[slot] is None:
                running[slot] = waiting.popleft()
                fresh.append(slot)
        while None in running:
            if running[-1] is not None:
                hole = running.index(None)
                cache.move(len(running) - 1, hole)
                running[hole] = running[-1]
            running.pop()
        return fresh

    @staticmethod
    def _share_prompts(running: list[_Seq], fresh: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """The fresh slots to prefill, one per prompt no running sequence holds, and the (holder, copy) slot pairs
        of the rest. An RL batch is G copies of each prompt: a copy takes the K/V of its prompt but the last token
        from a slot holding it (a running copy, kept across weight updates like its own, or this step's lead, once
        prefilled) and joins the next decode step with that last token, where its first token is drawn."""
        fresh_slots = set(fresh)
        holder = {tuple(s.prompt): slot for slot, s in enumerate(running) if slot not in fresh_slots}
        leads, shares = [], []
        for slot in fresh:
            key = tuple(running[slot].prompt)
            if key in holder:
                shares.append((holder[key], slot))
            else:
                holder[key] = slot
                leads.append(slot)
        return leads, shares

    def _take_shares(self, cache: KVCache, running: list[_Seq], shares: list[tuple[int, int]]) -> None:
        if not shares:
            return
        src, dst = [a for a, _ in shares], [b for _, b in shares]
        cache.move(src, dst, [len(running[b].prompt) - 1 for b in dst])
        for b in dst:
            running[b].feed = running[b].prompt[-1]

    def _prefill(self, cache: KVCache, running: list[_Seq], fresh: list[int], greedy: bool,
                 shares: list[tuple[int, int]] = ()) -> None:
        seqs = [running[i] for i in fresh]
        lens = torch.tensor([len(s.prompt) for s in seqs], device=self.device)
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s.prompt, dtype=torch.long) for s in seqs],
                                              batch_first=True, padding_value=self.pad_id).to(self.device)
        cols = torch.arange(ids.shape[1], device=self.device)
        rows = torch.tensor(fresh, device=self.device)
        cache.reset(rows)
        cache.bind(rows, lens)
        version = self.refresh_weights()
        hidden = self.model(ids, cols.expand_as(ids), cols[None] < lens[:, None], cache)
        self._take_shares(cache, running, shares)
        self._record(seqs, hidden[torch.arange(len(seqs), device=self.device), lens - 1], version, greedy)

    def _decode(self, cache: KVCache, running: list[_Seq], greedy: bool) -> None:
        pos = cache.lengths[: len(running), None].clone()  # the pending token's position
        ids = torch.tensor([[s.feed] for s in running], dtype=torch.long, device=self.device)
        mask = torch.arange(int(pos.max()) + 1, device=self.device)[None] <= pos
        version = self.refresh_weights()
        hidden = self.model(ids, pos, mask, cache)
        self._record(running, hidden[:, -1], version, greedy)

    def _record(self, seqs: list[_Seq], hidden, version: int, greedy: bool) -> None:
        s = self.spec
        logp = sampling_logprobs(self._logits(hidden), s.temperature, s.top_k, s.top_p)
        nxt = logp.argmax(-1) if greedy else self._draw(logp)
        lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
        stops = torch.isin(nxt, self.eos_ids).tolist()
        pauses = set(self.env.pause_ids) if self.env is not None else ()
        for seq, tok, tok_lp, stop in zip(seqs, nxt.tolist(), lp.tolist(), stops):
            out, seq.feed = seq.out, tok
            out.tokens.append(tok)
            out.logprobs.append(tok_lp)
            out.versions.append(version)
            if out.mask is not None:
                out.mask.append(1)
            if stop or len(out.tokens) >= seq.budget or tok in pauses:
                out.finish_reason = "stop" if stop else "length" if len(out.tokens) >= seq.budget else "tool"

    def _draw(self, logp):
        uniform = torch.rand(logp.shape[0], 1, generator=self.gen, dtype=torch.float64, device=self.device)
        return _inverse_cdf(logp.exp(), uniform)
