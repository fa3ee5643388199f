"""Context parallelism: each sequence split along its length across the ranks of a torch.distributed
group (Gloo on CPU, NCCL on GPU), so no rank holds a whole trace's activations. Every attention layer
trades the sequence split for a head split with one all-to-all, computes full causal attention for
its heads through the decoder's own attention (the same FP32 island), and trades back with one more:
one collective each way per layer, where ring attention needs CP - 1 sequential KV steps.

Heads: query heads are dealt out in order, ``ceil(nh / CP)`` per rank, the last rank's spare slots
filled with copies of the last head whose outputs are dropped (9 heads on 2 ranks: 5 + 5). Each rank
receives only the KV heads its query heads read; a KV head read by two ranks' queries is sent to
both, so fewer KV heads than ranks (or 3 KV heads on 2 ranks) works, at the price of that
replication. When head counts divide by CP each rank gets whole KV groups and nothing is replicated.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on dim 0 (chunk i goes to rank i); its gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, x = group, x.contiguous()
        out = torch.empty_like(x)  # contiguous too: the collective writes it in row-major order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


class _Gather(torch.autograd.Function):
    """All ranks' chunks concatenated along dim 1. Every rank computes the same loss from the whole,
    so the gradient of a rank's own chunk is its slice of the (identical) incoming gradient.
    ``anchor`` (the rank's hidden states) gets a zero gradient: a rank none of whose tokens is scored
    still runs its backward, whose all-to-alls the other ranks wait for."""

    @staticmethod
    def forward(ctx, x, anchor, group):
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        ctx.anchor = anchor.shape, anchor.dtype
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=1)[ctx.rank], grad.new_zeros(ctx.anchor[0], dtype=ctx.anchor[1]), None


def head_plan(nh: int, nkv: int, size: int, rank: int):
    """``(q_index, kv_index, local)``: the query heads sent to each rank (``size * m``), the KV heads
    sent to each rank (``size * k``), and, for this rank's ``m`` query slots, which received KV head
    each reads (None when they read consecutive whole groups, as the decoder's grouping expects)."""
    m, rep = -(-nh // size), nh // nkv
    q_index = [min(h, nh - 1) for h in range(size * m)]
    needs = [sorted({q_index[r * m + i] // rep for i in range(m)}) for r in range(size)]
    k = max(map(len, needs))
    kv_index = [h for need in needs for h in need + need[-1:] * (k - len(need))]
    local = [needs[rank].index(q_index[rank * m + i] // rep) for i in range(m)]
    grouped = m % k == 0 and local == [i // (m // k) for i in range(m)]
    return q_index, kv_index, None if grouped else local


class ContextParallel:
    """One model's split over ``group``: :meth:`shard` a sequence tensor, :meth:`attend` per layer,
    :meth:`gather` the per-token results once."""

    def __init__(self, group, nh: int, nkv: int, device=None):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.nh = nh
        q_index, kv_index, local = head_plan(nh, nkv, self.size, self.rank)
        self.q_index, self.kv_index = torch.tensor(q_index, device=device), torch.tensor(kv_index, device=device)
        self.local = None if local is None else torch.tensor(local, device=device)

    def pad(self, x, dim: int = 1):
        """``x`` padded with zeros (False) along ``dim`` to a multiple of the group's size."""
        extra = -x.shape[dim] % self.size
        return F.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, extra)) if extra else x

    def shard(self, x, dim: int = 1):
        """This rank's contiguous chunk of ``x`` (padded) along ``dim``."""
        return self.pad(x, dim).chunk(self.size, dim=dim)[self.rank]

    def gather(self, x, length: int, anchor):
        """``[N, Tc, ...]`` chunks of every rank -> ``[N, length, ...]`` on each (padding cut); ``anchor``:
        what ``x`` was computed from, kept in the graph whatever ``x`` holds."""
        return _Gather.apply(x, anchor, self.group)[:, :length]

    def attend(self, q, k, v, attention):
        """``attention(q, k, v)`` (``[B, heads, T, hd]`` -> ``[B, T, heads * hd]``) over the whole sequence
        for this rank's heads, from and back to this rank's tokens ``[B, Tc, nh * hd]``: q, k and v
        travel together in one all-to-all (in q's FP32 after RoPE; v returns to its dtype)."""
        b, _, tc, hd = q.shape
        parts = [x.index_select(1, i).view(b, self.size, -1, tc, hd)
                 for x, i in ((q, self.q_index), (k, self.kv_index), (v, self.kv_index))]
        y = _AllToAll.apply(torch.cat(parts, dim=2).transpose(0, 1), self.group)  # [src = chunk, B, heads, Tc, hd]
        y = y.permute(1, 2, 0, 3, 4).reshape(b, y.shape[2], self.size * tc, hd)
        m, kv = parts[0].shape[2], parts[1].shape[2]
        q, k, v = y.split([m, kv, kv], dim=1)
        if self.local is not None:  # KV heads shared unevenly: one per query head
            k, v = (x.index_select(1, self.local) for x in (k, v))
        out = attention(q, k, v.to(parts[2].dtype)).view(b, self.size, tc, m, hd).transpose(0, 1)
        y = _AllToAll.apply(out, self.group)  # [src rank = head slots, B, Tc, m, hd]
        return y.permute(1, 2, 0, 3, 4).reshape(b, tc, self.size * m * hd)[:, :, : self.nh * hd]


def group_of(size: int, device: torch.device):
    """The default process group, joined from the launcher's environment (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) when not yet; its size must be ``size``."""
    if not dist.is_initialized():
        if missing := [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]:
            raise ValueError(f"learner.context_parallel={size} needs one learner process per CP rank, each with "
                             f"torch.distributed's environment; {', '.join(missing)} not set")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != size:
        raise ValueError(f"learner.context_parallel={size} but the learner group has {dist.get_world_size()} "
                         "processes: start one learner process per CP rank")
    return dist.group.WORLD
