"""Shared-memory transport (one host): a sequence-locked double buffer in a ``/dev/shm`` file.

Region layout (one file, mapped by the learner read-write and by every actor read-only)::

    page 0   control words, int64 LE: MAGIC STATE PID HDR_LEN SLOT_BYTES LATEST CUR SEQ0 VER0
             SEQ1 VER1; the 32-byte layout hash at byte 128
    page 1.. the msgpack-encoded WeightUpdateHeader (version -1: the layout only)
    slot 0   one whole update: the header's buckets back to back (layout.views)
    slot 1   the same

Handover. The publisher writes version ``v`` into the slot ``CUR`` does *not* name: it makes
that slot's ``SEQ`` odd, copies the tensors, stores ``VER``, makes ``SEQ`` even again, and only
then points ``CUR`` at it and sets ``LATEST = v``. A reader reads ``CUR``, that slot's ``SEQ``
(must be even) and ``VER``, copies straight into its own tensors, and re-reads ``SEQ``: if it
moved, the publisher lapped the reader (two publishes during one copy) and the reader copies
again, so a returned version is never torn or mixed. The publisher never waits for readers.

Why a plain file and not ``multiprocessing.shared_memory``: before Python 3.13 every process
that *attaches* a SharedMemory registers it with its resource tracker, which unlinks the
learner's segment when an actor exits. A file in /dev/shm has no tracker; the publisher unlinks
it on close, and a crashed publisher's file is reclaimed by the next publisher of the same
run_dir. ``posix_fallocate`` reserves the memory up front, so a too-small /dev/shm (Docker's
64 MB default) is a clear error at start instead of a SIGBUS mid-run.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
import threading
import time
import warnings
import weakref
from typing import Mapping

import numpy as np
import torch

from core.messages import WeightUpdateHeader, decoder, encode
from weightsync import layout
from weightsync.base import Publisher, Subscriber, wait_until

PAGE = 4096
MAGIC = int.from_bytes(b"DRFTWS01", "little", signed=True)
READY, CLOSED = 1, 2
# control word indices
W_MAGIC, W_STATE, W_PID, W_HDR_LEN, W_SLOT_BYTES, W_LATEST, W_CUR = range(7)
W_SEQ = (7, 9)
W_VER = (8, 10)
N_WORDS = 16
HASH_AT = 128

_header_decoder = decoder(WeightUpdateHeader)
_barrier = threading.Lock()


def _fence() -> None:
    # x86-64 (TSO) keeps these stores/loads in order without help; elsewhere the lock's
    # acquire/release pairs (release followed by acquire is ordered) act as a full barrier
    with _barrier:
        pass
    with _barrier:
        pass


def region_path(run_dir: str) -> str:
    """One region per run directory, so two runs on one host never collide."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    digest = hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(base, f"driftrl-weights-{digest}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _map(fd: int, size: int, writable: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # MAP_POPULATE pre-faults the pages so the first publish/apply is not a page-fault storm
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=prot)


class _Region:
    """A mapped region: control words, header, and typed views of both slots."""

    def __init__(self, mm: mmap.mmap, ino: int):
        self.mm = mm
        self.ino = ino
        self.ctl = np.frombuffer(mm, dtype="<i8", count=N_WORDS)
        if int(self.ctl[W_MAGIC]) != MAGIC:
            raise RuntimeError("not a driftrl weight region (bad magic or format version)")
        hdr_len = int(self.ctl[W_HDR_LEN])
        self.header = _header_decoder.decode(mm[PAGE : PAGE + hdr_len])
        if layout.layout_hash(self.header) != mm[HASH_AT : HASH_AT + 32]:
            raise RuntimeError("weight region header does not match its layout hash (corrupt region)")
        self.payload = layout.payload_nbytes(self.header)
        slot_bytes = int(self.ctl[W_SLOT_BYTES])
        first = _round_page(PAGE + hdr_len)
        self.names = list(self.header.names)
        self.slot_views: list[list[torch.Tensor]] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # readers map read-only; they never write the views
            for s in range(2):
                flat = torch.frombuffer(mm, dtype=torch.uint8, count=slot_bytes, offset=first + s * slot_bytes)
                views = layout.views(self.header, flat)
                self.slot_views.append([views[n] for n in self.names])

    @classmethod
    def create(cls, path: str, header: WeightUpdateHeader) -> "_Region":
        hdr = encode(header)
        slot_bytes = _round_page(layout.total_nbytes(header))
        total = _round_page(PAGE + len(hdr)) + 2 * slot_bytes
        tmp = f"{path}.tmp{os.getpid()}"
        if os.path.exists(tmp):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise OSError(
                    e.errno, f"cannot reserve {total / 2**20:.0f} MiB for weights in "
                    f"{os.path.dirname(path)} ({e.strerror}); enlarge it (Docker: --shm-size) "
                    "or use weightsync.transport=filesystem"
                ) from None
            mm = _map(fd, total, writable=True)
            ino = os.fstat(fd).st_ino
            mm[PAGE : PAGE + len(hdr)] = hdr
            mm[HASH_AT : HASH_AT + 32] = layout.layout_hash(header)
            ctl = np.frombuffer(mm, dtype="<i8", count=N_WORDS)
            ctl[:] = 0
            ctl[W_PID] = os.getpid()
            ctl[W_HDR_LEN] = len(hdr)
            ctl[W_SLOT_BYTES] = slot_bytes
            ctl[W_LATEST] = ctl[W_CUR] = ctl[W_VER[0]] = ctl[W_VER[1]] = -1
            ctl[W_MAGIC] = MAGIC
            ctl[W_STATE] = READY
            del ctl
            region = cls(mm, ino)
            os.rename(tmp, path)  # atomic: readers see no region or a complete one
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return region

    @classmethod
    def open(cls, path: str) -> "_Region | None":
        """The ready region at ``path``, or None if there is none (yet)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size < PAGE:
                return None
            mm = _map(fd, st.st_size, writable=False)
        finally:
            os.close(fd)
        try:
            region = cls(mm, st.st_ino)
        except BaseException:
            mm.close()
            raise
        if int(region.ctl[W_STATE]) != READY:
            region.close()
            return None
        return region

    def close(self) -> None:
        self.slot_views = []
        self.ctl = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes when it is collected


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    # one C++ call for all tensors (dtype-converting and strided copies included) instead of a
    # Python loop of copy_: the loop costs ~1 us per tensor, a visible share for small models
    if _foreach_copy is not None:
        try:
            _foreach_copy(dst, src)
            return
        except RuntimeError:
            pass  # a combination it does not take (e.g. mixed devices): copies are idempotent
    for d, s in zip(dst, src):
        d.copy_(s)


_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _round_page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _retire_stale(path: str) -> None:
    """Refuse to share a run_dir with a live publisher; mark a dead one's region CLOSED so its
    readers move to ours."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        if os.fstat(fd).st_size < PAGE:
            return
        mm = mmap.mmap(fd, PAGE)
    finally:
        os.close(fd)
    ctl = np.frombuffer(mm, dtype="<i8", count=N_WORDS)
    pid = int(ctl[W_PID])
    live = int(ctl[W_MAGIC]) == MAGIC and int(ctl[W_STATE]) == READY and _pid_alive(pid)
    if not live:
        ctl[W_STATE] = CLOSED
    del ctl
    mm.close()
    if live:
        raise RuntimeError(f"a weight publisher (pid {pid}) is already live for this run_dir ({path})")


def _retire_own(path: str, ino: int, ctl: np.ndarray) -> None:
    ctl[W_STATE] = CLOSED
    try:
        if os.stat(path).st_ino == ino:  # not a successor's region
            os.unlink(path)
    except FileNotFoundError:
        pass


class ShmPublisher(Publisher):
    transport = "shm"

    def __init__(self, run_dir: str, template: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20):
        super().__init__(layout.header_for(-1, template, bucket_bytes))
        self.path = region_path(run_dir)
        _retire_stale(self.path)
        self._region = _Region.create(self.path, self.header)
        self._cur = -1
        # also at interpreter exit or garbage collection: readers learn the publisher is gone
        # and /dev/shm does not keep the region (a SIGKILLed learner's region is reclaimed by
        # the next publisher of this run_dir instead)
        self._retire = weakref.finalize(self, _retire_own, self.path, self._region.ino, self._region.ctl)

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int:
        r = self._region
        ctl = r.ctl
        s = 0 if self._cur < 0 else 1 - self._cur
        seq = int(ctl[W_SEQ[s]])
        ctl[W_SEQ[s]] = seq + 1  # odd: slot s is being written
        _fence()
        ok = False
        try:
            _copy_all(r.slot_views[s], [named[n] for n in r.names])
            ok = True
        finally:
            _fence()
            ctl[W_VER[s]] = version if ok else -1  # a failed write never passes as a version
            ctl[W_SEQ[s]] = seq + 2
        _fence()
        ctl[W_CUR] = s
        ctl[W_LATEST] = version
        self._cur = s
        return r.payload

    def _close(self) -> None:
        self._retire()
        self._region.close()


class ShmSubscriber(Subscriber):
    """Reads the region of ``run_dir``'s publisher; waits up to ``timeout_s`` for it to appear.

    If the publisher closes and a new one (a restarted learner) creates a region for the same
    run_dir, the subscriber moves to it on its next ``latest_version()``/``apply()``.
    ``apply_timeout_s`` bounds retries when the publisher keeps overwriting the slot mid-copy.
    """

    transport = "shm"

    def __init__(self, run_dir: str, timeout_s: float = 60, apply_timeout_s: float = 30):
        super().__init__()
        self.path = region_path(run_dir)
        self.apply_timeout_s = apply_timeout_s
        self._next_reattach = 0.0
        self._region = wait_until(
            lambda: _Region.open(self.path), timeout_s,
            f"the weight publisher of run_dir {run_dir!r} (shared memory {self.path}); is the learner up?",
        )

    def latest_version(self) -> int:
        ctl = self._region.ctl
        if ctl[W_STATE] != READY:
            self._maybe_reattach()
            ctl = self._region.ctl
        return int(ctl[W_LATEST])

    @property
    def publisher_closed(self) -> bool:
        return int(self._region.ctl[W_STATE]) != READY

    def _maybe_reattach(self) -> None:
        now = time.monotonic()
        if now < self._next_reattach:
            return
        self._next_reattach = now + 0.5  # the publisher is gone: poll for a successor, gently
        try:
            if os.stat(self.path).st_ino == self._region.ino:
                return
        except FileNotFoundError:
            return
        new = _Region.open(self.path)
        if new is not None:
            self._region.close()
            self._region = new

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        self.latest_version()  # moves to a successor region if there is one
        r = self._region
        layout.check_targets(r.header, named, role="shm subscriber")
        ctl = r.ctl
        deadline = time.monotonic() + self.apply_timeout_s
        spins = 0
        while int(ctl[W_LATEST]) > after:
            s = int(ctl[W_CUR])
            seq = int(ctl[W_SEQ[s]])
            _fence()  # VER and the data are read after SEQ, never before
            version = int(ctl[W_VER[s]])
            if not seq & 1 and version > after:
                _copy_all([named[n] for n in r.names], r.slot_views[s])
                _fence()
                if int(ctl[W_SEQ[s]]) == seq:
                    return version, r.payload
                self.stats.torn_retries += 1
            spins += 1
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shm subscriber: no consistent copy in {self.apply_timeout_s}s "
                    f"({self.stats.torn_retries} torn copies): the publisher overwrites slots faster "
                    "than this reader copies them"
                )
            time.sleep(0 if spins < 100 else 1e-4)
        return None

    def _close(self) -> None:
        self._region.close()
