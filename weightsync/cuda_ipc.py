"""CUDA IPC transport (one shared GPU): weight slots in device memory, never through the host. Which slot is free is
the shm transport's question: its file ``i`` holds the *record* of slot ``i`` (:class:`IpcSlot`), kept open by a reader
until its device copy is synchronised. Copied, never mapped: CUDA IPC memory dies with its exporter (a restarted
learner). ``share`` / ``opener``: stand-ins in the tests."""

from __future__ import annotations

import os
import struct
from typing import Mapping

import msgspec
import torch

from core.messages import IpcSlot
from weightsync import layout
from weightsync.base import Publisher, Subscriber
from weightsync.files import ShmPublisher, ShmSubscriber

RECORD = "ipc"  # the one tensor of a record file
_LEN = struct.Struct("<Q")  # the record's length, before its bytes

_slot_decoder = msgspec.msgpack.Decoder(IpcSlot)
_encoder = msgspec.msgpack.Encoder()


def share_cuda(flat: torch.Tensor) -> tuple:
    """``flat``'s storage shared by CUDA IPC: the fields of :class:`IpcSlot` from ``device`` on."""
    if flat.device.type != "cuda":
        raise ValueError(f"cuda_ipc shares CUDA memory, but the slot is on {flat.device}: set learner.device "
                         "and actor.device to one CUDA device (or use weightsync.transport=shm)")
    return flat.untyped_storage()._share_cuda_()


def open_cuda(rec: IpcSlot) -> torch.Tensor:
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(*msgspec.structs.astuple(rec)[1:-1])  # share_cuda's fields
    flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", rec.device))
    return flat.set_(storage, 0, (rec.size_bytes,), (1,))


def encode_record(rec: IpcSlot, capacity: int) -> torch.Tensor:
    """``rec`` as ``capacity`` uint8 bytes: its length, its msgpack bytes, zeros."""
    raw = _encoder.encode(rec)
    if _LEN.size + len(raw) > capacity:
        raise ValueError(f"an IpcSlot record of {len(raw)} bytes does not fit {capacity} bytes")
    return torch.frombuffer(bytearray((_LEN.pack(len(raw)) + raw).ljust(capacity, b"\0")), dtype=torch.uint8)


def decode_record(data: bytes) -> IpcSlot:
    (n,) = _LEN.unpack_from(data)
    if not 0 < n <= len(data) - _LEN.size:
        raise ValueError(f"cuda_ipc record length {n} does not fit its {len(data)}-byte slot (not a record)")
    try:
        return _slot_decoder.decode(data[_LEN.size : _LEN.size + n])
    except msgspec.DecodeError as e:
        raise ValueError(f"cuda_ipc record is not an IpcSlot: {e}") from None


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    try:  # one C++ call instead of ~1 us of Python per tensor, a visible share for small models
        torch._foreach_copy_(dst, src)
    except RuntimeError:  # a combination it does not take (mixed devices); copies are idempotent
        for d, s in zip(dst, src):
            d.copy_(s)


def _sync(device: torch.device) -> None:
    # another process reads the slot on its own stream: the bytes must be there first
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class _Control(ShmPublisher):
    """shm files, file ``i`` holding the record of ``owner``'s device slot ``i``; one version visible."""

    keep = 1

    def __init__(self, run_dir: str, owner: "CudaIpcPublisher"):
        super().__init__(run_dir, {RECORD: owner.records[0]}, max_files=owner.slots)
        self.owner = owner

    def _fill(self, f, named) -> int:
        o = self.owner
        _copy_all(o.views[f.index], [named[n] for n in o.header.names])
        _sync(o.device)
        return super()._fill(f, {RECORD: o.records[f.index]})

    def _no_leases(self) -> None:
        # without leases nothing tells when a reader has finished copying out of a device slot
        raise RuntimeError(f"cuda_ipc needs file leases in {self.dir} to know which device slot is free "
                           "(fcntl F_SETLEASE); use weightsync.transport=shm")


class CudaIpcPublisher(Publisher):
    """``2 + max_readers`` device slots (one visible, one being written, one per reader copying): no waits."""

    transport = "cuda_ipc"

    def __init__(self, run_dir: str, template: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20, *,
                 max_readers: int = 4, share=share_cuda):
        super().__init__(layout.header_for(-1, template, bucket_bytes))
        self.device = next(iter(template.values())).device
        self.slots = 2 + max_readers
        nbytes = layout.total_nbytes(self.header)
        flats = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.slots)]
        self.views = [list(map(layout.views(self.header, flat).get, self.header.names)) for flat in flats]
        records = [IpcSlot(s, *share(flat), layout=self.header) for s, flat in enumerate(flats)]
        capacity = _LEN.size + max(len(_encoder.encode(r)) for r in records)
        self.records = [encode_record(r, capacity) for r in records]
        self._control = _Control(run_dir, self)

    @classmethod
    def from_config(cls, cfg, run_dir: str, template: Mapping[str, torch.Tensor], *, stop=None) -> "CudaIpcPublisher":
        # one reader per actor plus a spare (a restarted actor, a debugging reader)
        return cls(run_dir, template, cfg.weightsync.bucket_mb << 20, max_readers=cfg.actor.num_actors + 1)

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int | None:
        # the control publisher's own publish() would check ``named`` against its record layout
        return None if self._control._write(version, named) is None else layout.payload_nbytes(self.header)

    def _close(self) -> None:
        self._control.close()


class CudaIpcSubscriber(Subscriber):
    """Copies the newest version device to device into the targets (``device``: the actor's)."""

    transport = "cuda_ipc"

    def __init__(self, run_dir: str, timeout_s: float = 60, *, device=None, stop=None, opener=open_cuda):
        super().__init__()
        self.device = torch.device(device if device is not None else "cuda")
        self._control = ShmSubscriber(run_dir, timeout_s, stop=stop)  # reads the records
        self._opener, self._opened_from = opener, self._control.dir
        self._opened: dict[tuple[bytes | None, int], torch.Tensor] = {}

    def latest_version(self) -> int:
        return self._control.latest_version()

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        if (files := self._control.open_newest(after)) is None:
            return None
        (got,) = files  # the control publisher sends full versions only
        with got:  # the record's file stays open, so its device slot is not reused, until the copy is done
            _, off, nbytes, *_ = got.plan.tensors[0]
            rec = decode_record(os.pread(got.fd, nbytes, off))
            layout.check_targets(rec.layout, named, role="cuda_ipc subscriber")
            views = layout.views(rec.layout, self._open(rec)[: layout.total_nbytes(rec.layout)])
            _copy_all([named[n] for n in rec.layout.names], [views[n] for n in rec.layout.names])
            _sync(self.device)  # honest apply_s, and done before the file is let go
        return got.version, layout.payload_nbytes(rec.layout)

    def _open(self, rec: IpcSlot) -> torch.Tensor:
        if self._control.dir != self._opened_from:  # a restarted learner: the old handles are dead memory
            self._opened, self._opened_from = {}, self._control.dir
        key = (rec.handle, rec.offset_bytes)
        if key not in self._opened:
            self._opened[key] = self._opener(rec)
        return self._opened[key]

    def _close(self) -> None:
        self._opened.clear()
        self._control.close()
