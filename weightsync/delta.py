"""Delta publishing (ARCHITECTURE.md, "Deltas"): a version as the elements whose bits changed since the previous one,
compared in the actors' dtype, so a reader that applied every delta since a full version holds exactly the bits of a
full publish. In BF16 most updates round to no change; in FP32 nearly all change and the full version is smaller."""

from __future__ import annotations

import secrets

import torch

from core.messages import DeltaHeader

EPOCH_CHARS = 16  # an epoch: a publisher's random hex name

INDEX = torch.int32  # element index inside its tensor: layouts are checked below 2**31 elements a tensor
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PAD = 8  # every segment starts at a multiple of 8 bytes, so each is a plain typed view


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_AS_INT[t.element_size()])


def _seg(n: int) -> int:
    return (n + _PAD - 1) // _PAD * _PAD


def segments(counts: list[int], itemsizes: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Per tensor, where its indices and its values start in the payload; the payload's length."""
    out, at = [], 0
    for n, size in zip(counts, itemsizes):
        out.append((at, at + _seg(n * INDEX.itemsize)))
        at = out[-1][1] + _seg(n * size)
    return out, at


def apply(header: DeltaHeader, payload: torch.Tensor, targets: list[torch.Tensor], dtypes: list[torch.dtype]) -> None:
    """Write a delta (1-D uint8 ``payload``: per tensor its indices, then its values in ``dtypes``) into ``targets``
    (the reader's own tensors, holding version ``header.base``); a misfit payload or index fails before any write."""
    sizes = [d.itemsize for d in dtypes]
    starts, total = segments(header.counts, sizes)
    if payload.numel() != total or len(header.counts) != len(dtypes):
        raise ValueError(f"delta v{header.version}: {payload.numel()} payload bytes for {len(header.counts)} tensors, "
                         f"its header says {total} bytes for {len(dtypes)}")
    parts = [(payload[i: i + n * INDEX.itemsize].view(INDEX), payload[v: v + n * size].view(d))
             for (i, v), n, size, d in zip(starts, header.counts, sizes, dtypes)]
    for t, (idx, _) in zip(targets, parts):
        if not t.is_contiguous():
            raise ValueError("a delta is applied to contiguous tensors only")
        if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < t.numel():
            raise ValueError(f"delta v{header.version}: an index beyond a tensor of {t.numel()} elements")
    for t, (idx, vals) in zip(targets, parts):
        if idx.numel():
            t.view(-1).index_copy_(0, idx.to(device=t.device, dtype=torch.long), vals.to(t.device, t.dtype))


class Encoder:
    """The publisher's side: one copy of the last published tensors (in the published dtype).
    ``encode`` proposes; ``commit`` records what was actually published (a skipped publish changes nothing)."""

    def __init__(self, full_every: int):
        self.full_every, self.epoch = full_every, secrets.token_hex(EPOCH_CHARS // 2)
        self.prev: list[torch.Tensor] | None = None
        self.version = self.full = -1
        self.changed_frac = 1.0  # of the last version's elements, against the one before it

    def encode(self, version: int, tensors: list[torch.Tensor]) -> tuple[DeltaHeader, torch.Tensor] | None:
        """``(header, payload)``, or None where the full version is due or the smaller one."""
        if self.prev is None:
            return None
        changed = [(_bits(t) != _bits(p)).nonzero().squeeze(1).to(INDEX) for t, p in zip(tensors, self.prev)]
        counts = [c.numel() for c in changed]
        self.changed_frac = sum(counts) / max(1, sum(t.numel() for t in tensors))
        starts, total = segments(counts, [t.element_size() for t in tensors])
        if version - self.full >= self.full_every or total >= sum(t.nbytes for t in tensors):
            return None
        payload = torch.zeros(total, dtype=torch.uint8, device=tensors[0].device)
        for (i, v), idx, t in zip(starts, changed, tensors):
            payload[i: i + idx.numel() * INDEX.itemsize].view(INDEX).copy_(idx)
            payload[v: v + idx.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1)[idx.long()])
        return DeltaHeader(version, self.version, self.full, self.epoch, counts), payload

    def commit(self, version: int, tensors: list[torch.Tensor], full: bool) -> None:
        if self.prev is None:
            self.prev = [t.detach().clone().contiguous() for t in tensors]
        else:
            torch._foreach_copy_(self.prev, tensors)
        self.version, self.full = version, version if full else self.full
