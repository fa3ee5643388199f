"""The one place the body's and the attention's precision is decided, for the learner's and the
engine's paths alike: the autocast of the body (``auto``: core/precision.py) and the FP32
attention island (ARCHITECTURE.md: Precision and the ratio). The LM head's is
learner/logprobs.py's.
"""

from __future__ import annotations

import contextlib

import torch

from core import precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def body_autocast(dtype_name: str, device: str = "cpu"):
    """Run the model body's matmuls in ``dtype_name`` (``auto``: core/precision.py for ``device``);
    FP32 means no autocast at all."""
    dtype_name = precision.dtype_name(dtype_name, device)
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=DTYPES[dtype_name])


def _island(device_type: str = "cpu"):
    """No autocast inside the island: under a BF16 autocast torch.matmul would round its FP32
    operands (and its output) back to BF16, which is exactly what the island is for avoiding.
    Autocast is per device type, so it is the operands' device type that is switched off."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def attention_probs(a, b, bias, scale: float, dim: int, fp32: bool, dtype: torch.dtype):
    """softmax(a @ b * scale + bias) over ``dim``: the attention-precision decision, one place for
    the learner's and the engine's paths (ARCHITECTURE.md: Precision and the ratio). ``dtype`` is the body's compute dtype.

    ``fp32`` (the island): the scores are the FP32 product of q and k as they arrive -- FP32 from
    the rotary embedding (which runs in FP32), keys read back from a BF16 engine's cache in BF16.
    On CPU the operands are upcast first: BF16 -> FP32 is exact and so is the product of two 8-bit
    mantissas, so for BF16 operands this is what a GPU tensor core computes (BF16 inputs, FP32
    accumulate and output). Nothing rounds the scores before the softmax, which runs in FP32.
    Off: q and k are rounded to ``dtype``, the scores come out of a ``dtype`` matmul (in BF16 a
    logit of 20 is then only known to 0.06) and the softmax runs in ``dtype``: all-BF16."""
    with _island(a.device.type):
        if not fp32:
            scores = torch.matmul(a.to(dtype), b.to(dtype)) * scale
            return torch.softmax(scores + bias.to(dtype), dim=dim)
        wide = torch.promote_types(a.dtype, torch.float32)  # a float64 reference stays float64
        return torch.softmax(torch.matmul(a.to(wide), b.to(wide)) * scale + bias.to(wide), dim=dim)


def attention_values(probs, v):
    """``probs @ v``, rounded to ``v``'s dtype (the body's) once on the way out. FP32
    probabilities stay FP32 for the product, ``v`` upcast exactly: a deliberate choice. Rounding
    them to BF16 first, as FlashAttention-style GPU kernels do, costs each weight up to 2^-9
    relative, and on CPU the FP32 matmul is no slower (faster without native BF16). Body-dtype
    probabilities (island off) meet ``v`` in that dtype."""
    with _island(probs.device.type):
        return torch.matmul(probs, v.to(probs.dtype)).to(v.dtype)
