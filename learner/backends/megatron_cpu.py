"""The few megatron-core helpers that reach for CUDA unasked, replaced so a GPTModel trains in one CPU
process: process groups (a world of one gloo process), the attention scratch buffer, the CUDA RNG
tracker (the learner trains without dropout: megatron's no-op inference tracker), the rotary table,
and the tensor-parallel linears, which re-enter autocast in backward for CUDA only (a bf16 gradient
then meets an fp32 weight): with one rank they are ``F.linear``.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import GlobalMemoryBuffer


def init_host(device: torch.device) -> None:
    """World size 1, all parallel sizes 1, the scratch buffer on ``device``, the dropout-free RNG tracker;
    idempotent (the contract check and the learner may build backends in one process)."""
    if not dist.is_initialized():
        # gloo's device listens on the address the hostname resolves to: keep it on loopback,
        # unless the user chose an interface
        chosen = "GLOO_SOCKET_IFNAME" in os.environ
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        finally:
            if not chosen:
                del os.environ["GLOO_SOCKET_IFNAME"]
    if dist.get_world_size() != 1:
        raise ValueError(f"learner.backend='megatron' runs in one process (tensor/pipeline parallel size 1); "
                         f"torch.distributed is already initialised with world_size={dist.get_world_size()}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, HostMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = HostMemoryBuffer(device)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class HostMemoryBuffer(GlobalMemoryBuffer):
    """``GlobalMemoryBuffer`` allocating on a given device instead of ``torch.cuda.current_device()``."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device=self.device)
        return buf[:required].view(*tensor_shape)


class HostRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose table stays on ``inv_freq``'s device (non-interleaved only: Llama/Qwen)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, dim], as megatron's


def host_linears(model: torch.nn.Module) -> None:
    """Route every tensor-parallel linear of a CPU ``model`` through ``F.linear``."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            # the instance's, not the class's
            module._forward_impl = lambda input, weight, bias=None, *args, **kwargs: F.linear(input, weight, bias)
