"""The actor's KV cache: pre-allocated per-layer K/V, and the cached attention over it.

The cache owns its layout, so the decoder hands it the new queries, keys and values
(:meth:`KVCache.attend`) and it writes them and computes attention; ``Qwen3.forward`` calls
:meth:`KVCache.advance` once all layers have run. This is the lock-step layout: every row of the
batch is at the same length (prompts left-padded).
"""

from __future__ import annotations

import torch


class KVCache:
    """Pre-allocated per-layer K/V for a batch decoded in lock-step (left-padded prompts)."""

    def __init__(self, cfg, batch: int, max_len: int, dtype, device="cpu"):
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.length = 0
        self.max_len = max_len

    def update(self, layer: int, k, v):
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} > {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, t: int) -> None:
        self.length += t

    def attend(self, layer: int, q, k, v, bias):
        """Write ``k``/``v`` [B, nkv, T, hd] at the cache's length and attend ``q`` [B, nh, T, hd]
        over every cached key; ``bias`` [B, 1, T, S] is 0 where allowed, -inf-like elsewhere.
        Softmax in FP32 (the actor's numerics are the engine's own, DESIGN §4). [B, T, nh*hd]."""
        k, v = self.update(layer, k.to(self.k[0].dtype), v.to(self.v[0].dtype))
        b, nh, t, hd = q.shape
        rep = nh // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3).to(q.dtype)) * (hd**-0.5)
        probs = torch.softmax(scores.float() + bias, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, t, nh * hd)
