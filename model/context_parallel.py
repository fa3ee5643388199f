"""Context parallelism: each sequence split along its length across a torch.distributed group (Gloo on CPU,
NCCL on GPU), so no rank holds a whole trace's activations. Each attention layer trades the sequence split for
a head split with one all-to-all, attends over the whole sequence with the decoder's attention (the same FP32
island) and trades back: one collective each way per layer, where ring attention needs CP - 1 KV steps. Heads
(:func:`head_plan`): ``ceil(nh / CP)`` query heads per rank in order, spare slots copying the last head, their
outputs dropped (9 heads on 2 ranks: 5 + 5). A rank receives only the KV heads its queries read (fewer KV
heads than ranks works); none is sent twice when CP divides both counts."""

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
    """All ranks' chunks concatenated along dim 1. Every rank computes the same loss from the whole, so the gradient
    of a rank's chunk is its slice of the (identical) incoming one. ``anchor`` (the rank's hidden states) gets a zero
    gradient: a rank none of whose tokens is scored still runs its backward, whose all-to-alls the others wait for."""

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
    """``(q_index, kv_index, local)``: the query and the KV heads sent to each rank (``size * m``, ``size * k``) and
    which received KV head each of this rank's ``m`` query slots reads (None: consecutive whole groups, as grouped)."""
    m, rep = -(-nh // size), nh // nkv
    q_index = [min(h, nh - 1) for h in range(size * m)]
    needs = [sorted({q_index[r * m + i] // rep for i in range(m)}) for r in range(size)]
    k = max(map(len, needs))
    kv_index = [h for need in needs for h in need + need[-1:] * (k - len(need))]
    local = [needs[rank].index(q_index[rank * m + i] // rep) for i in range(m)]
    grouped = m % k == 0 and local == [i // (m // k) for i in range(m)]
    return q_index, kv_index, None if grouped else local


class ContextParallel:
    """One model's split over ``group``: :meth:`shard` its inputs, :meth:`attend` per layer, :meth:`gather` once."""

    def __init__(self, group, nh: int, nkv: int, device=None):
        self.group, self.size, self.rank, self.nh = group, dist.get_world_size(group), dist.get_rank(group), nh
        q_index, kv_index, local = head_plan(nh, nkv, self.size, self.rank)
        self.q_index, self.kv_index = torch.tensor(q_index, device=device), torch.tensor(kv_index, device=device)
        self.local = None if local is None else torch.tensor(local, device=device)

    def pad(self, x):
        """``x`` padded with zeros (False) along dim 1 to a multiple of the group's size."""
        extra = -x.shape[1] % self.size
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, extra)) if extra else x

    def shard(self, x):
        """This rank's contiguous chunk of ``x`` (padded) along dim 1."""
        return self.pad(x).chunk(self.size, dim=1)[self.rank]

    def gather(self, x, length: int, anchor):
        """``[N, Tc, ...]`` chunks of every rank -> ``[N, length, ...]`` on each (padding cut); ``anchor``:
        what ``x`` was computed from, kept in the graph whatever ``x`` holds."""
        return _Gather.apply(x, anchor, self.group)[:, :length]

    def attend(self, q, k, v, attention):
        """``attention(q, k, v)`` (``[B, heads, T, hd]`` -> ``[B, T, heads * hd]``) for this rank's heads over the
        whole sequence, from and back to its tokens ``[B, Tc, nh * hd]``; q, k, v share one all-to-all in q's FP32
        (after RoPE), v then cast back to its dtype."""
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
    """The default process group, joined from torch.distributed's environment when not yet, of ``size`` ranks."""
    if not dist.is_initialized():
        if missing := [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]:
            raise ValueError(f"learner.context_parallel={size} needs one learner process per CP rank, each with "
                             f"torch.distributed's environment; {', '.join(missing)} not set")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != size:
        raise ValueError(f"learner.context_parallel={size} but the learner group has {dist.get_world_size()} "
                         "processes: start one learner process per CP rank")
    return dist.group.WORLD
