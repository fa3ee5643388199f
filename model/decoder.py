"""One decoder for the Llama, Qwen2 and Qwen3 families (switches: model/arch.py), ours rather than transformers':
the actor swaps weights under a live KV cache, the learner controls attention and head precision. Names, shapes
and numerics follow transformers exactly (tests/unit/test_families.py). RMSNorm and rope cos/sin stay FP32."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.arch import ArchConfig
from model.attention import DTYPES, attention_probs, attention_values, body_autocast  # noqa: F401 (re-exports)
from model.kvcache import KVCache
from model.rope import inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        # no module at all where the family has none: state_dict keys are exactly the checkpoint's
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, bias, cache: KVCache | None, fp32_softmax: bool, cp=None):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cp is not None:  # model/context_parallel.py: this rank's heads over the whole sequence
            return self.o_proj(cp.attend(q, k, v, lambda q, k, v: self._attend_full(q, k, v, bias, fp32_softmax)))
        if cache is None:
            return self.o_proj(self._attend_full(q, k, v, bias, fp32_softmax))
        # the actor's path: the cache owns its layout, so it writes k/v and computes attention
        return self.o_proj(cache.attend(self.layer, q, k, v, bias, fp32_softmax))

    def _attend_full(self, q, k, v, bias, fp32_softmax: bool):
        """Cache-free attention (the learner's): queries grouped per kv head (no repeat_interleave) and
        scores built transposed, ``[B, nkv, S, rep*T]``: torch's CPU softmax over a short last dim is
        ~4x slower (learner step 51.8 -> 45.6 ms, measured)."""
        b, nh, t, hd = q.shape  # the model's heads, or one context-parallel rank's
        nkv = k.shape[1]
        rep = nh // nkv
        qg = q.reshape(b, nkv, rep * t, hd)
        bias = bias.transpose(2, 3)
        if rep > 1:
            bias = bias.repeat(1, 1, 1, rep)  # column r*T + i is query i of head kv*rep + r
        probs_t = attention_probs(k, qg.transpose(2, 3), bias, hd**-0.5, -2, fp32_softmax, v.dtype)
        out = attention_values(probs_t.transpose(2, 3), v)  # [B, nkv, rep*T, hd]
        return out.view(b, nh, t, hd).transpose(1, 2).reshape(b, t, nh * hd)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ArchConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, i)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, bias, cache, fp32_softmax, cp=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, bias, cache, fp32_softmax, cp)
        return x + self.mlp(self.post_attention_layernorm(x))


class Rotary(nn.Module):
    """FP32 cos/sin ``[B, 1, T, hd]`` of each position, times the rope type's attention factor."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        inv, self.scale = inv_freq(cfg.rope(), cfg.head_dim, cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves apply, downcasts do not: BF16 frequencies are radians off a few thousand positions in."""
        inv = self.inv_freq
        super()._apply(fn, recurse)
        if not inv.is_meta:
            self.inv_freq = inv.to(self.inv_freq.device, torch.promote_types(self.inv_freq.dtype, torch.float32))
        return self

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale)[:, None], (emb.sin() * self.scale)[:, None]


class Decoder(nn.Module):
    """``forward`` returns final-normed hidden states; the head is applied by the caller."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(dict(embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),  # HF's names
                                        layers=nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers)),
                                        norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.fp32_attn_softmax = True
        self.checkpoint_layers = False  # a learner's choice (learner.checkpoint_layers)

    @classmethod
    def shapes(cls, cfg: ArchConfig) -> dict[str, tuple[int, ...]]:
        """Every state_dict name and shape of a model of ``cfg``, without allocating it."""
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in cls(cfg).state_dict().items()}

    @classmethod
    def from_state(cls, cfg: ArchConfig, state: dict[str, torch.Tensor]) -> "Decoder":
        """A model holding ``state``'s tensors, assigned on the meta device: no weight is initialised
        first (minutes and a second model-sized allocation for a 7B checkpoint)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = Rotary(cfg)  # not in the state (not persistent): built for real
        return model

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids, position_ids, key_mask, cache: KVCache | None = None, cp=None):
        """input_ids/position_ids [B, T]; key_mask [B, S] bool over all keys (cache + new), True = attend.
        ``cp`` (model/context_parallel.py): ids/positions are this rank's chunk, key_mask the whole sequence's."""
        x = self.model.embed_tokens(input_ids)
        s = key_mask.shape[1]
        t = input_ids.shape[1] if cp is None else s  # CP: each rank's attention takes every query
        allowed = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t) & key_mask[:, None, None, :]
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=x.device)
        bias.masked_fill_(~allowed, torch.finfo(torch.float32).min)
        cos, sin = self.rotary(position_ids)
        again = self.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.model.layers:
            args = (x, cos, sin, bias, cache, self.fp32_attn_softmax, cp)
            x = checkpoint(layer, *args, use_reentrant=False) if again else layer(*args)
        if cache is not None:
            cache.advance(t)
        return self.model.norm(x)

    def logits(self, hidden, head: torch.Tensor | None = None):
        """FP32 logits (the FP32 head); ``head``: its weight already in FP32 (an engine keeps one between tokens)."""
        return F.linear(hidden.float(), (self.head_weight() if head is None else head).float())


Qwen3 = Decoder  # the name most callers know it by
