"""The one place the body's and the attention's precision is decided, for the learner's and the
engine's paths alike: the body's autocast and the FP32 attention island."""

from __future__ import annotations

import contextlib

import torch

from core import precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def body_autocast(dtype_name: str, device: str = "cpu"):
    """The body's matmuls in ``dtype_name`` (``auto``: core/precision.py); FP32: no autocast."""
    dtype_name = precision.dtype_name(dtype_name, device)
    return contextlib.nullcontext() if dtype_name == "float32" else torch.autocast(device, dtype=DTYPES[dtype_name])


def _island(device_type: str):
    """No autocast inside the island: a BF16 autocast would round its FP32 matmuls back to BF16."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def attention_probs(a, b, bias, scale: float, dim: int, fp32: bool, dtype: torch.dtype):
    """softmax(a @ b * scale + bias) over ``dim``. ``fp32`` (the island): operands upcast exactly,
    FP32 scores and softmax -- what a GPU tensor core computes from BF16 inputs. Off: all in the
    body's ``dtype`` (in BF16 a logit of 20 is known only to 0.06)."""
    wide = torch.promote_types(a.dtype, torch.float32) if fp32 else dtype  # a float64 reference stays float64
    with _island(a.device.type):
        return torch.softmax(torch.matmul(a.to(wide), b.to(wide)) * scale + bias.to(wide), dim=dim)


def attention_values(probs, v):
    """``probs @ v`` in the probabilities' dtype, rounded to ``v``'s once on the way out (FP32
    probabilities are not rounded to BF16 first as FlashAttention does: up to 2^-9 per weight)."""
    with _island(probs.device.type):
        return torch.matmul(probs, v.to(probs.dtype)).to(v.dtype)
