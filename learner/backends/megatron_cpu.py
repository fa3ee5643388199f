"""The few megatron-core helpers that assume CUDA, replaced so a GPTModel trains in one CPU process.

megatron-core 0.16.1 builds and runs its local (no TransformerEngine, no Apex) GPT layers on any
device, except for the helpers below, which reach for the GPU unasked. Each shim replaces exactly
one of them, and each is device-correct -- it uses the model's device, whatever that is -- so
nothing breaks on a host that also has a GPU (learner/backends/megatron.py keeps the model on the
CPU, like the torch backend):

- process groups: ``parallel_state.initialize_model_parallel`` needs ``torch.distributed``; a
  world of one gloo process (in-memory store: no rendezvous port; the gloo device bound to the
  loopback interface), tensor/pipeline/context parallel size 1, so no collective ever runs.
  Not a replacement: the setup megatron expects, in its smallest form.
- ``GlobalMemoryBuffer.get_tensor`` (the attention-scores scratch of ``DotProductAttention``)
  allocates on ``torch.cuda.current_device()``: :class:`HostMemoryBuffer` allocates on the model's.
- the CUDA RNG tracker: ``get_cuda_rng_tracker().fork()`` (around attention and embedding dropout)
  saves and restores the CUDA generator. The learner trains without dropout (``core_config`` in
  learner/backends/megatron.py sets both dropouts to 0), so there is no random stream to fork:
  megatron's own no-op tracker (the one it uses for inference) is installed.
- ``RotaryEmbedding.get_emb`` moves a CPU ``inv_freq`` to ``torch.cuda.current_device()`` on
  first use: :class:`HostRotaryEmbedding` leaves it where the model is.
- ``LinearWithGradAccumulationAndAsyncCommunication`` (every ``ColumnParallelLinear`` /
  ``RowParallelLinear``) re-enters autocast in backward through ``custom_bwd(device_type="cuda")``
  only, so under CPU autocast its backward multiplies a bf16 gradient by an fp32 weight and
  fails. With one tensor-parallel rank, no sequence parallelism and no gradient-accumulation
  fusion, that function is ``input @ weight.T + bias`` plus communication that never happens;
  :func:`host_linears` routes the layers of CPU models through ``F.linear``, whose autograd
  honours CPU autocast.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def _env(key: str, value: str):
    """``key=value`` for the duration, unless the user already chose a value."""
    if key in os.environ:
        yield
        return
    os.environ[key] = value
    try:
        yield
    finally:
        os.environ.pop(key, None)


def init_parallel_state() -> None:
    """World size 1, all parallel sizes 1; idempotent (the contract check and the learner loop may
    build backends in one process). ValueError if torch.distributed already runs a larger world."""
    if not dist.is_initialized():
        # gloo's device listens on the address the hostname resolves to: keep it on loopback
        with _env("GLOO_SOCKET_IFNAME", "lo"):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise ValueError(f"learner.backend='megatron' runs in one process (tensor/pipeline parallel size 1); "
                         f"torch.distributed is already initialised with world_size={dist.get_world_size()}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)


def install_host_helpers(device: torch.device) -> None:
    """The scratch buffer on ``device`` and the dropout-free RNG tracker (see the module docstring)."""
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
    """``RotaryEmbedding`` whose table stays on ``inv_freq``'s device (non-interleaved only: the
    Llama/Qwen families rotate halves, and ``core_config`` sets ``rotary_interleaved=False``)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, dim], as megatron's


def _plain_linear(input, weight, bias=None, *args, **kwargs):
    return F.linear(input, weight, bias)


def host_linears(model: torch.nn.Module) -> None:
    """Route every tensor-parallel linear of a CPU ``model`` through ``F.linear`` (module docstring)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            weight = getattr(module, "weight", None)
            if weight is not None and weight.device.type == "cpu":
                module._forward_impl = _plain_linear  # the instance's, not the class's
