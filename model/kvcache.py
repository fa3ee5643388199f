"""The actor's KV cache: preallocated per-slot K/V (zeroed: a masked column is never NaN), a length per slot,
the cached attention. A forward over B rows uses slots [0, B) unless :meth:`bind` names others; its T new tokens
are the last T of the S columns (T > 1: a prefill of empty rows or lock-step; T = 1 may mix lengths). GQA stacks
a kv head's queries (``repeat_interleave`` took 33 of ~200 ms)."""

from __future__ import annotations

import torch

from model.attention import attention_probs, attention_values


class KVCache:
    def __init__(self, cfg, slots: int, max_len: int, dtype, device="cpu"):
        shape = (slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.slots, self.max_len = slots, max_len
        self._rows = self._valid = self._where = None

    def fits(self, slots: int, max_len: int) -> bool:
        return slots <= self.slots and max_len <= self.max_len

    def bind(self, rows: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """The next forward's row ``b`` is slot ``rows[b]`` with ``valid[b]`` real tokens (default: T)."""
        self._rows, self._valid = rows, valid

    def reset(self, slots) -> None:
        """Empty ``slots`` for new sequences (their stale K/V stay, masked, until overwritten)."""
        self.lengths[slots] = 0

    def move(self, src, dst, lengths=None) -> None:
        """Copy slot ``src``'s sequence into slot ``dst`` (or each of a list into its partner): once, instead of
        a gather on every later step. ``lengths``: only each one's first positions (a shared prompt's)."""
        lengths = self.lengths[src] if lengths is None else torch.as_tensor(lengths, device=self.lengths.device)
        n = int(lengths.max())
        for buf in (*self.k, *self.v):
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = lengths

    def _targets(self, b: int, t: int):
        """(slot index [B, 1], positions [B, T]) the new keys go to; computed once per forward."""
        if self._where is None:
            if self._rows is None and b > self.slots:
                raise RuntimeError(f"KV cache overflow: a forward over {b} rows, the cache has {self.slots} slots")
            rows = self._rows if self._rows is not None else torch.arange(b, device=self.lengths.device)
            pos = self.lengths[rows][:, None] + torch.arange(t, device=rows.device)
            if (end := int(pos[:, -1].max())) >= self.max_len:
                raise RuntimeError(f"KV cache overflow: position {end} in a cache of {self.max_len} positions per slot")
            self._where = rows[:, None], pos
        return self._where

    def advance(self, t: int) -> None:
        """After a forward's last layer: its rows grow by ``t`` (or by their ``valid`` counts)."""
        if self._where is not None:
            self.lengths[self._where[0][:, 0]] += t if self._valid is None else self._valid
        self._rows = self._valid = self._where = None

    def attend(self, layer: int, q, k, v, bias, fp32_softmax: bool = True):
        """Write ``k``/``v`` [B, nkv, T, hd] at each row's length, attend ``q`` [B, nh, T, hd] over each
        row's first S keys (``bias`` [B, 1, T, S]); returns [B, T, nh*hd]. Plain matmuls, not SDPA: a
        135M-shape decode step took 61 ms so against 66-73 ms with SDPA (batch 32 x 172, measured)."""
        rows, pos = self._targets(k.shape[0], k.shape[2])
        self.k[layer][rows, :, pos] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, pos] = v.transpose(1, 2).to(self.v[layer].dtype)
        sel = slice(k.shape[0]) if self._rows is None else self._rows  # a slice: a view, no copy
        keys, vals = self.k[layer][sel, :, : bias.shape[-1]], self.v[layer][sel, :, : bias.shape[-1]]
        b, nh, t, hd = q.shape
        rep = nh // keys.shape[1]
        qg = q.reshape(b, keys.shape[1], rep * t, hd)  # row r*T + i: query i of head kv*rep + r
        if rep > 1 and t > 1:
            bias = bias.repeat(1, 1, rep, 1)
        probs = attention_probs(qg, keys.transpose(2, 3), bias, hd**-0.5, -1, fp32_softmax, vals.dtype)
        out = attention_values(probs, vals)  # [B, nkv, rep*T, hd]
        return out.view(b, nh, t, hd).transpose(1, 2).reshape(b, t, nh * hd)
