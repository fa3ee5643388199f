"""cuda_ipc without a GPU: its records (msgspec bytes, never pickle) and its slot discipline (a
device slot is reused only once no reader has its record file open).

The two CUDA calls (``share`` = ``_share_cuda_``, ``opener`` = ``_new_shared_cuda``) are replaced by
an in-process registry: the "opened" slot is the publisher's own slot tensor, so a reader sees
exactly what the publisher wrote, and a slot rewritten under a reader would show. The real IPC
path is tests/gpu/test_weightsync_gpu.py.
"""

from __future__ import annotations

import os
import secrets
import time

import pytest
import torch

from core.config import ConfigError, load
from weightsync import check_devices
from weightsync import cuda_ipc, files
from weightsync.base import make_publisher


class _Registry:
    """Stands in for the CUDA driver's IPC handles: handle bytes -> the shared tensor."""

    def __init__(self):
        self.slots: dict[bytes, torch.Tensor] = {}

    def share(self, flat):
        handle = secrets.token_bytes(64)  # a cudaIpcMemHandle_t is 64 bytes
        self.slots[handle] = flat
        return 0, handle, flat.numel(), 0, secrets.token_bytes(16), 7, secrets.token_bytes(64), False

    def open(self, rec):
        return self.slots[rec.handle]


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed": torch.randn(40, 8, generator=g).bfloat16(), "q": torch.randn(8, 8, generator=g),
            "step": torch.tensor([version], dtype=torch.int64)}


@pytest.fixture
def run_dir(tmp_path):
    yield str(tmp_path)
    files.remove_dead_region(str(tmp_path))  # a failing test leaves nothing in /dev/shm


def test_record_round_trips_and_refuses_garbage():
    header = cuda_ipc.layout.header_for(-1, _state(0), 1 << 20)
    rec = cuda_ipc.IpcSlot(2, 0, b"\x00\xff" * 32, 4096, 512, b"rc", 3, None, True, header)
    buf = cuda_ipc.encode_record(rec, 4096)
    assert buf.dtype == torch.uint8 and buf.numel() == 4096
    assert cuda_ipc.decode_record(buf.numpy().tobytes()) == rec
    with pytest.raises(ValueError, match="does not fit"):
        cuda_ipc.encode_record(rec, 16)
    with pytest.raises(ValueError, match="record"):
        cuda_ipc.decode_record(bytes(64))


def test_publish_apply_is_bit_exact_and_converts(run_dir):
    reg = _Registry()
    pub = cuda_ipc.CudaIpcPublisher(run_dir, _state(0), 1 << 10, max_readers=2, share=reg.share)
    same = cuda_ipc.CudaIpcSubscriber(run_dir, 5, device="cpu", opener=reg.open)
    wide = cuda_ipc.CudaIpcSubscriber(run_dir, 5, device="cpu", opener=reg.open)
    assert same.apply({k: torch.zeros_like(v) for k, v in _state(0).items()}) is None  # nothing yet
    assert pub.publish(0, _state(0)).bytes == sum(t.nbytes for t in _state(0).values())
    got = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    got_wide = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in _state(0).items()}
    assert same.apply(got) == 0 and wide.apply(got_wide) == 0
    assert all(torch.equal(got[k], v) for k, v in _state(0).items())
    assert all(torch.equal(got_wide[k], v.double()) for k, v in _state(0).items())
    for s in (same, wide, pub):
        s.close()


def test_a_slot_a_reader_copies_from_is_never_rewritten(run_dir, monkeypatch):
    reg = _Registry()
    pub = cuda_ipc.CudaIpcPublisher(run_dir, _state(0), max_readers=1, share=reg.share)
    sub = cuda_ipc.CudaIpcSubscriber(run_dir, 5, device="cpu", opener=reg.open)
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    pub.publish(5, _state(5))
    real_copy, armed, unchanged = cuda_ipc._copy_all, [True], []

    def copy_while_publishing(dst, src):
        if armed and armed.pop():  # the reader's device copy: the learner moves on meanwhile
            (opened,) = sub._opened.values()  # the device slot version 5 is in
            before = opened.clone()
            for v in range(6, 6 + 3 * pub.slots):
                assert pub.publish(v, _state(v)) is not None  # 2 + readers slots: a publish never waits
            unchanged.append(torch.equal(opened, before))
        real_copy(dst, src)

    monkeypatch.setattr(cuda_ipc, "_copy_all", copy_while_publishing)
    assert sub.apply(target) == 5
    assert unchanged == [True]  # its slot was not rewritten under the copy
    assert all(torch.equal(target[k], v) for k, v in _state(5).items())
    newest = 5 + 3 * pub.slots
    assert sub.latest_version() == newest and sub.apply(target) == newest
    assert all(torch.equal(target[k], v) for k, v in _state(newest).items())
    assert len(sub._opened) >= 2 and sub.stats.versions_skipped > 0
    sub.close()
    pub.close()


def test_the_transport_refuses_host_memory(run_dir):
    cfg = load(None, ['weightsync.transport="cuda_ipc"'])
    with pytest.raises(ValueError, match="learner.device"):
        make_publisher(cfg, run_dir, _state(0))
    
    with pytest.raises(ConfigError, match="cuda_ipc"):
        check_devices(cfg, n_gpus=0)
    assert check_devices(cfg, n_gpus=1) == ("cuda:0", ["cuda:0"])


def test_a_restarted_publisher_is_followed_with_fresh_handles(run_dir):
    reg = _Registry()
    pub = cuda_ipc.CudaIpcPublisher(run_dir, _state(0), max_readers=1, share=reg.share)
    sub = cuda_ipc.CudaIpcSubscriber(run_dir, 5, device="cpu", opener=reg.open)
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    pub.publish(0, _state(0))
    assert sub.apply(target) == 0
    pub.close()
    assert not os.path.isdir(sub._control.dir)  # the publisher is gone
    pub = cuda_ipc.CudaIpcPublisher(run_dir, _state(0), max_readers=1, share=reg.share)  # the restarted learner
    pub.publish(4, _state(4))
    deadline = time.monotonic() + 5
    while sub.latest_version() != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sub.apply(target) == 4
    assert all(torch.equal(target[k], v) for k, v in _state(4).items())
    assert len(sub._opened) == 1  # the dead publisher's slots were dropped
    sub.close()
    pub.close()
