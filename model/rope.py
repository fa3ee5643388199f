"""Rotary embeddings: a checkpoint's rope settings (transformers 4's ``rope_scaling``, 5's ``rope_parameters``)
-> inverse frequencies and cos/sin scale, bit-identical to ``modeling_rope_utils`` (FP32, the same operations):
default, linear, llama3, yarn. ``dynamic`` and ``longrope`` follow the running length, which a KV cache written
earlier cannot: refused."""

from __future__ import annotations

import math

import torch


def rope_parameters(d: dict, max_position_embeddings: int) -> dict:
    """The effective rope settings of config dict ``d`` (``rope_type``, ``rope_theta``, the type's keys)."""
    raw = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config.json rope_scaling/rope_parameters={raw!r}: expected an object")
    if raw and all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"config.json rope_parameters keyed by layer type ({sorted(raw)}) is not supported")
    p = {k: v for k, v in raw.items() if k != "type"}
    kind = p["rope_type"] = raw.get("rope_type", raw.get("type", "default"))
    if p.get("rope_theta") is None:
        p["rope_theta"] = d.get("rope_theta") or 10000.0
    if kind in ("llama3", "yarn", "longrope"):  # a top-level value (Phi-3 style) wins, as in transformers
        p["original_max_position_embeddings"] = d.get(
            "original_max_position_embeddings", p.get("original_max_position_embeddings", max_position_embeddings))
    if kind not in INIT:
        raise ValueError(f"config.json rope type {kind!r} is not supported (driftrl implements {sorted(INIT)}; "
                         f"'dynamic' and 'longrope' depend on the running sequence length)")
    partial = p.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json partial_rotary_factor={partial!r} is not supported: "
                         "llama/qwen2/qwen3 rotate the whole head")
    for key in REQUIRED[kind]:
        if p.get(key) is None:
            raise ValueError(f"config.json rope type {kind!r} needs {key!r} (got {p.get(key)!r})")
    return p


def _base(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(p: dict, dim: int, max_pos: int):
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp between."""
    inv = _base(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(p: dict, factor: float) -> float:
    """YaRN's cos/sin scale: given, or from ``factor`` (and ``mscale``/``mscale_all_dim`` when both set)."""
    if p.get("attention_factor") is not None:
        return p["attention_factor"]
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
    return _yarn_mscale(factor)


def _yarn(p: dict, dim: int, max_pos: int):
    base, omax = p["rope_theta"], p["original_max_position_embeddings"]
    # a null factor means "the context was stretched from original_max_position_embeddings to max"
    factor = p.get("factor") or max_pos / omax

    def dim_of(rotations):  # dimensions below low extrapolate, above high interpolate (beta_fast/beta_slow)
        return (dim * math.log(omax / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(p.get("beta_fast") or 32), dim_of(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of each dimension that keeps its original frequency
    return interpolation * (1 - keep) + extrapolation * keep, _yarn_attention_factor(p, factor)


INIT = {"default": lambda p, dim, max_pos: (_base(p["rope_theta"], dim), 1.0),
        "linear": lambda p, dim, max_pos: (_base(p["rope_theta"], dim) / p["factor"], 1.0),
        "llama3": _llama3, "yarn": _yarn}
REQUIRED = {"default": (), "linear": ("factor",), "yarn": (),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def inv_freq(p: dict, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """FP32 inverse frequencies ``[head_dim/2]`` and the factor cos/sin are multiplied by."""
    inv, scale = INIT[p["rope_type"]](p, head_dim, max_position_embeddings)
    return inv.float(), float(scale)
