"""Named weight tensors with arbitrary bit patterns, for the weight-transport tests."""

from __future__ import annotations

import torch


def random_weights(specs, seed: int) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``specs`` (``(name, dtype, shape)``) filled with random bytes -- NaNs
    included, so a test compares bit-exactly, not by value; ``seed`` makes each version its own."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, dtype, shape in specs:
        n = torch.Size(shape).numel() * dtype.itemsize
        out[name] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)
    return out
