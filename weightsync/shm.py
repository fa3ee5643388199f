"""Shared-memory transport (one host): weight slots in a ``/dev/shm`` file; a reader pins the slot
it uses, so an actor can *map* the published weights instead of copying them.

Region layout (one file; the learner maps it read-write; an actor maps the control area
read-write, for its reader entry, and the slots read-only)::

    control  int64 LE words: MAGIC STATE PID PID_START HDR_LEN SLOT_BYTES N_SLOTS MAX_READERS
             LATEST CUR; the 32-byte layout hash at byte 128; from word 32: VER[s] for each
             slot, then one (PID, START, NS, PIN) entry per reader
    header   the msgpack-encoded WeightUpdateHeader (version -1: the layout only)
    slots    N_SLOTS whole updates, each the header's buckets back to back (layout.views)

Protocol. CUR, VER and the reader table are read and written only under ``flock`` on the region
file: a kernel lock, so it orders memory like any lock and dies with its holder. Each critical
section is a few words; the bulk bytes move outside it.

* publish(v): [lock] pick a slot s that is neither CUR nor any reader's PIN; VER[s] = -1
  [unlock]; copy the tensors into s; [lock] VER[s] = v, CUR = s, LATEST = v [unlock].
* apply(): [lock] s = CUR; PIN[me] = s (this drops my previous pin); rebind every target that
  can map it (a CPU tensor of the published dtype) to its view of s, ``t.data = view``
  [unlock]. Other targets (dtype-converting, or on a GPU) are then copied out of s, and if
  nothing was mapped, [lock] PIN[me] = -1 [unlock].

A slot is written only while it is neither CUR nor pinned, and readers pin only CUR, under the
same lock: a reader never reads a slot being written (no torn versions, nothing to retry), and
weights mapped into an actor never change under it. The rebinding happens under the lock, so
even between dropping the old pin and rebinding, no slot an actor references is writable.

Worked example: 2 readers (A maps, B copies), max_readers=2, so 4 slots::

    publish 7  -> slot 0                      CUR=0   pins A=-  B=-
    A applies: pins 0, maps slot 0                    pins A=0  B=-
    publish 8  -> slot 1 (0 is CUR)           CUR=1
    B applies: pins 1, copies, unpins                 pins A=0  B=-
    publish 9  -> slot 2 (1 is CUR, 0 pinned) CUR=2
    publish 10 -> slot 1 (2 is CUR, 0 pinned) CUR=1   (A still computes with version 7)
    A applies: pins 1, maps version 10, drops 0       pins A=1  B=-
    publish 11 -> slot 0                      CUR=0

Each reader pins at most one slot and CUR is one more, so with 2 + max_readers slots a free slot
always exists and a publish never waits. With fewer slots (``slots=``, to save memory) a publish
that finds none waits up to ``wait_s`` for a reader to move on, then skips that version
(``publish`` returns None, ``Publisher.skipped`` counts it): a slow actor never holds up training.

Dead readers. An entry records its pid, the process start time and pid namespace. An entry
whose process is gone, a zombie, or another process that reuses the pid is reclaimed when a
reader registers or when a publisher finds no free slot, so a SIGKILLed actor leaks nothing.
Entries from another pid namespace (a container sharing /dev/shm) are never reclaimed: their
pids mean nothing here, and wrongly freeing a pin corrupts weights. There is deliberately no
heartbeat timeout: a slow but live actor still reads its mapped slot, and taking its pin would
change weights under it. A subscriber releases its entry on close(), when collected, and at
interpreter exit; tensors it mapped must not be used after that (their slot may be rewritten).
Mapped tensors are read-only memory: an in-place write to them faults (SIGSEGV) rather than
corrupting weights other actors use. A forked child shares its parent's lock; it must open its
own subscriber.

Strangers on the host. /dev/shm is shared by every user, so a region's name is random
(``driftrl-weights-<128 random bits>``), created exclusively (``O_EXCL``, mode 0600, never
through a symlink) and recorded in ``run_dir/weights.shm`` (0600): nobody can pre-create the
name a publisher will use. A subscriber opens only the recorded name, and refuses
(:class:`UnsafeRegion`) a region or record that another uid owns or that group/other may read or
write: mapping another user's file would let them choose the actor's weights.

Why a plain file and not ``multiprocessing.shared_memory``: before Python 3.13 every process
that *attaches* a SharedMemory registers it with its resource tracker, which unlinks the
learner's segment when an actor exits. A file in /dev/shm has no tracker; the publisher unlinks
it on close, and a crashed (SIGKILLed) publisher's region, found through the run_dir record, is
marked closed and unlinked by the next publisher of the same run_dir. ``posix_fallocate``
reserves the memory up front, so a too-small /dev/shm (Docker's 64 MB default) is a clear error
at start instead of a SIGBUS mid-run.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import time
import warnings
import weakref
from typing import Mapping

import numpy as np
import torch

from core.messages import WeightUpdateHeader, decoder, encode
from weightsync import layout
from core.files import atomic_write
from weightsync.base import Publisher, Subscriber, wait_until

log = logging.getLogger(__name__)

PAGE = 4096
MAGIC = int.from_bytes(b"DRFTWS02", "little", signed=True)
READY, CLOSED = 1, 2
# control word indices
W_MAGIC, W_STATE, W_PID, W_PID_START, W_HDR_LEN, W_SLOT_BYTES, W_SLOTS, W_READERS, W_LATEST, W_CUR = range(10)
HASH_AT = 128
W_TABLES = 32  # VER[n_slots], then the reader entries
PID, START, NS, PIN = range(4)  # columns of a reader entry
ENTRY_WORDS = 4

RECORD = "weights.shm"  # in run_dir: the path of the newest publisher's region
_NAME = re.compile(r"driftrl-weights-[0-9a-f]{32}")

_header_decoder = decoder(WeightUpdateHeader)


class _Busy(RuntimeError):
    """The region lock stayed taken longer than the caller is willing to wait."""


class UnsafeRegion(PermissionError):
    """A region (or its run_dir record) that another user owns or could read or write."""


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _new_region_path() -> str:
    # unpredictable, so no other user can create the name before the publisher does
    return os.path.join(_shm_dir(), f"driftrl-weights-{secrets.token_hex(16)}")


def region_path(run_dir: str) -> str | None:
    """The region recorded for ``run_dir`` by its newest publisher; None before the first."""
    record = os.path.join(run_dir, RECORD)
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink someone put there
        raise UnsafeRegion(f"refusing {record}: {e.strerror}") from None
    try:
        _check_private(fd, record)
        path = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if os.path.dirname(path) != _shm_dir() or not _NAME.fullmatch(os.path.basename(path)):
        raise UnsafeRegion(f"refusing {record}: {path[:200]!r} is not a driftrl weight region name")
    return path


def _check_private(fd: int, path: str) -> None:
    """Refuse a file of another uid, or one group/other may read or write: its bytes, and so the
    weights, would be theirs to choose."""
    st, me = os.fstat(fd), os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeRegion(f"refusing {path}: not a regular file")
    if st.st_uid != me:
        raise UnsafeRegion(f"refusing {path}: owned by uid {st.st_uid}, not by this process's uid {me}")
    if st.st_mode & 0o077:
        raise UnsafeRegion(f"refusing {path}: mode {st.st_mode & 0o777:04o} lets other users read or "
                           "write it (a driftrl region is 0600)")


def _open_private(path: str) -> int | None:
    """An O_RDWR fd of ``path`` after the owner/mode check; None if it does not exist."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # EACCES: another user's 0600 file; ELOOP: a symlink
        raise UnsafeRegion(f"refusing {path}: {e.strerror} (not this user's region)") from None
    try:
        _check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- process liveness ------------------------------------------------------------------------

_HAVE_PROC = os.path.exists("/proc/self/stat")


def _proc_start(pid: int) -> int | None:
    """Start time (clock ticks after boot) of a running process; None if it is gone or a zombie
    (a SIGKILLed child stays a zombie until its parent reaps it). 0 where /proc is missing."""
    if not _HAVE_PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, owned by another user
            return 0
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name in (...) may hold spaces
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_MY_NS = _pid_ns()


def _alive(pid: int, start: int, ns: int = _MY_NS) -> bool:
    if ns != _MY_NS:
        return True  # another pid namespace: cannot tell, so never presume it dead
    now = _proc_start(pid)
    return now is not None and (start == 0 or now == start)  # another start: the pid was reused


def _me() -> tuple[int, int, int]:
    """(pid, start, pid namespace) of this process, as a reader entry records them."""
    return os.getpid(), _proc_start(os.getpid()) or 0, _MY_NS


# ---- the region ------------------------------------------------------------------------------


def _round_page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _geometry(n_slots: int, max_readers: int, hdr_len: int, slot_bytes: int) -> tuple[int, int, int, int]:
    """(control words, header offset, first slot offset, file size)."""
    words = W_TABLES + n_slots + ENTRY_WORDS * max_readers
    hdr_at = _round_page(words * 8)
    first = hdr_at + _round_page(hdr_len)
    return words, hdr_at, first, first + n_slots * slot_bytes


def _map(fd: int, size: int, writable: bool, offset: int = 0) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # MAP_POPULATE pre-faults the pages so the first publish/apply is not a page-fault storm
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=prot, offset=offset)


@contextlib.contextmanager
def _flock(fd: int, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    spins = 0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise _Busy(f"the weight region lock stayed taken for {timeout_s:.2f}s") from None
            spins += 1
            time.sleep(0 if spins < 100 else 1e-4)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _release(fd: int, table: np.ndarray, entry: int | None, pid: int) -> None:
    """Free this process's reader entry (not a forked child's copy of it) and close the fd."""
    try:
        if entry is not None and os.getpid() == pid:
            with _flock(fd, 1.0):
                table[entry] = (0, 0, 0, -1)
    except _Busy:  # a stuck lock holder: the entry is reclaimed once this process is gone
        return
    finally:
        os.close(fd)


class _Region:
    """A mapped region: control words, reader table, header, and typed views of every slot."""

    def __init__(self, path: str, fd: int, ctl_mm: mmap.mmap, slots_mm: mmap.mmap, slots_at: int):
        self.path, self.fd, self.mms = path, fd, [ctl_mm, slots_mm]
        self.ino = os.fstat(fd).st_ino
        head = np.frombuffer(ctl_mm, dtype="<i8", count=W_TABLES)
        if int(head[W_MAGIC]) != MAGIC:
            raise RuntimeError("not a driftrl weight region (bad magic or format version)")
        self.n_slots, self.max_readers = int(head[W_SLOTS]), int(head[W_READERS])
        hdr_len, slot_bytes = int(head[W_HDR_LEN]), int(head[W_SLOT_BYTES])
        del head
        words, hdr_at, _, _ = _geometry(self.n_slots, self.max_readers, hdr_len, slot_bytes)
        self.ctl = np.frombuffer(ctl_mm, dtype="<i8", count=words)
        self.vers = self.ctl[W_TABLES : W_TABLES + self.n_slots]
        self.table = self.ctl[W_TABLES + self.n_slots :].reshape(self.max_readers, ENTRY_WORDS)
        self.header = _header_decoder.decode(ctl_mm[hdr_at : hdr_at + hdr_len])
        if layout.layout_hash(self.header) != ctl_mm[HASH_AT : HASH_AT + 32]:
            raise RuntimeError("weight region header does not match its layout hash (corrupt region)")
        self.payload = layout.payload_nbytes(self.header)
        self.names = list(self.header.names)
        self.slot_views: list[list[torch.Tensor]] = []
        # normal tensors even if opened inside inference_mode (a reattach mid-generation):
        # a parameter rebound to an inference tensor would itself become one
        with warnings.catch_warnings(), torch.inference_mode(False):
            warnings.simplefilter("ignore")  # readers map the slots read-only and never write them
            for s in range(self.n_slots):
                flat = torch.frombuffer(slots_mm, dtype=torch.uint8, count=slot_bytes, offset=slots_at + s * slot_bytes)
                views = layout.views(self.header, flat)
                self.slot_views.append([views[n] for n in self.names])
        self.entry: int | None = None
        self._finalizer = weakref.finalize(self, _release, fd, self.table, None, os.getpid())

    @classmethod
    def create(cls, path: str, header: WeightUpdateHeader, n_slots: int, max_readers: int) -> "_Region":
        hdr = encode(header)
        slot_bytes = _round_page(layout.total_nbytes(header))
        words, hdr_at, first, total = _geometry(n_slots, max_readers, len(hdr), slot_bytes)
        tmp = f"{path}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise UnsafeRegion(f"{tmp} already exists: someone else created this name; refusing to share it") from None
        os.fchmod(fd, 0o600)  # whatever the umask
        region = None
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise OSError(
                    e.errno, f"cannot reserve {total / 2**20:.0f} MiB ({n_slots} weight slots) in "
                    f"{os.path.dirname(path)} ({e.strerror}); enlarge it (Docker: --shm-size), "
                    "publish with fewer slots, or use weightsync.transport=filesystem"
                ) from None
            mm = _map(fd, total, writable=True)
            mm[hdr_at : hdr_at + len(hdr)] = hdr
            ctl = np.frombuffer(mm, dtype="<i8", count=words)
            ctl[:] = 0
            mm[HASH_AT : HASH_AT + 32] = layout.layout_hash(header)  # words 16-19
            ctl[W_PID], ctl[W_PID_START] = _me()[:2]
            ctl[W_HDR_LEN], ctl[W_SLOT_BYTES] = len(hdr), slot_bytes
            ctl[W_SLOTS], ctl[W_READERS] = n_slots, max_readers
            ctl[W_LATEST] = ctl[W_CUR] = -1
            ctl[W_TABLES : W_TABLES + n_slots] = -1
            ctl[W_TABLES + n_slots :].reshape(max_readers, ENTRY_WORDS)[:, PIN] = -1
            ctl[W_MAGIC], ctl[W_STATE] = MAGIC, READY
            del ctl
            region = cls(path, fd, mm, mm, first)
            try:  # atomic and exclusive (unlike rename): readers see no region or a complete one
                os.link(tmp, path)
            except FileExistsError:
                raise UnsafeRegion(f"{path} already exists: someone else created this name; "
                                   "refusing to share it") from None
        except BaseException:
            if region is not None:
                region.close()  # closes fd too
            else:
                os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return region

    @classmethod
    def open(cls, path: str) -> "_Region | None":
        """The ready region at ``path`` (with an entry in its reader table), or None if there is
        none (yet); UnsafeRegion if another user could have written it."""
        fd = _open_private(path)
        if fd is None:
            return None
        try:
            head = np.frombuffer(os.pread(fd, W_TABLES * 8, 0), dtype="<i8")
            if len(head) < W_TABLES or int(head[W_STATE]) != READY:
                os.close(fd)
                return None
            n_slots, max_readers = int(head[W_SLOTS]), int(head[W_READERS])
            _, _, first, total = _geometry(n_slots, max_readers, int(head[W_HDR_LEN]), int(head[W_SLOT_BYTES]))
            if int(head[W_MAGIC]) != MAGIC or os.fstat(fd).st_size != total:
                raise RuntimeError(f"{path} is not a driftrl weight region of this format version "
                                   "(a learner of another driftrl version?)")
            region = cls(path, fd, _map(fd, first, writable=True),
                         _map(fd, total - first, writable=False, offset=first), 0)
        except BaseException:
            os.close(fd)
            raise
        try:
            region.register()
        except BaseException:
            region.close()
            raise
        return region

    def locked(self, timeout_s: float):
        return _flock(self.fd, timeout_s)

    # the three helpers below run under the lock

    def free_slot(self) -> int | None:
        cur = int(self.ctl[W_CUR])
        pinned = set(self.table[self.table[:, PID] != 0, PIN].tolist())
        return next((s for s in range(self.n_slots) if s != cur and s not in pinned), None)

    def reap(self) -> int:
        """Free the entries of readers whose process is gone; how many."""
        dead = [i for i, (pid, start, ns, _) in enumerate(self.table.tolist()) if pid and not _alive(pid, start, ns)]
        for i in dead:
            self.table[i] = (0, 0, 0, -1)
        return len(dead)

    def register(self) -> None:
        with self.locked(5.0):
            self.reap()
            free = np.flatnonzero(self.table[:, PID] == 0)
            if not len(free):
                pids = self.table[:, PID].tolist()
                raise RuntimeError(
                    f"all {self.max_readers} reader entries of the weight region are held by live "
                    f"processes {pids}; the publisher was made for at most {self.max_readers} readers"
                )
            self.entry = int(free[0])
            self.table[self.entry] = (*_me(), -1)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self.fd, self.table, self.entry, os.getpid())

    def close(self) -> None:
        self._finalizer()  # frees the reader entry, closes the fd (and so the flock)
        # never mm.close(): torch.frombuffer tensors keep the mmap object alive but do not block
        # close(), which would unmap weights an actor still computes with (SIGSEGV). Dropping
        # our references unmaps it once the last view is gone.
        self.slot_views, self.ctl, self.vers, self.table, self.mms = [], None, None, None, []


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    # one C++ call for all tensors (dtype-converting and strided copies included) instead of a
    # Python loop of copy_: the loop costs ~1 us per tensor, a visible share for small models
    if _foreach_copy is not None:
        # a combination it does not take (e.g. mixed devices) falls back below: copies are idempotent
        with contextlib.suppress(RuntimeError):
            _foreach_copy(dst, src)
            return
    for d, s in zip(dst, src):
        d.copy_(s)


_foreach_copy = getattr(torch, "_foreach_copy_", None)


def remove_dead_region(run_dir: str) -> int:
    """Remove the region recorded for ``run_dir`` if its publisher is dead (a SIGKILLed
    learner's), marked CLOSED first so its readers look for a successor. Returns the pid of a
    live publisher (whose region stays), else 0. A publisher calls it before creating its
    own; a launcher may call it once the learner is gone, so /dev/shm keeps nothing."""
    try:
        path = region_path(run_dir)
    except UnsafeRegion as e:
        log.warning("ignoring the weight region record: %s", e)  # the next publisher replaces it
        return 0
    if path is None:
        return 0
    with contextlib.suppress(OSError):  # gone already, or (sticky /dev/shm) not ours to remove
        os.unlink(f"{path}.tmp")  # a publisher that died while creating its region
    try:
        fd = _open_private(path)
    except UnsafeRegion as e:
        log.warning("not touching the recorded weight region: %s", e)
        return 0
    if fd is None:
        return 0
    try:
        live = _mark_closed_unless_live(fd)
    finally:
        os.close(fd)
    if not live:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return live


def _mark_closed_unless_live(fd: int) -> int:
    """The pid of the live publisher owning the region at ``fd``; else marks it CLOSED, 0."""
    if os.fstat(fd).st_size < PAGE:
        return 0
    mm = mmap.mmap(fd, PAGE)
    ctl = np.frombuffer(mm, dtype="<i8", count=W_TABLES)
    pid = int(ctl[W_PID])
    live = int(ctl[W_MAGIC]) == MAGIC and int(ctl[W_STATE]) == READY and _alive(pid, int(ctl[W_PID_START]))
    if not live:
        ctl[W_STATE] = CLOSED
    del ctl
    mm.close()
    return pid if live else 0


def _retire_own(path: str, ino: int, ctl: np.ndarray) -> None:
    ctl[W_STATE] = CLOSED
    with contextlib.suppress(FileNotFoundError):  # already gone is fine
        if os.stat(path).st_ino == ino:  # not a successor's region
            os.unlink(path)


class ShmPublisher(Publisher):
    """``max_readers``: subscribers that may be attached at once; ``slots``: weight copies kept
    in shared memory (default 2 + max_readers: a publish never waits); ``wait_s``: how long a
    publish waits for a free slot, or for the lock, before it skips the version."""

    transport = "shm"

    def __init__(self, run_dir: str, template: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20, *,
                 max_readers: int = 4, slots: int | None = None, wait_s: float = 0.1):
        super().__init__(layout.header_for(-1, template, bucket_bytes))
        slots = 2 + max_readers if slots is None else slots
        if max_readers < 1 or slots < 2:
            raise ValueError(f"need max_readers >= 1 and slots >= 2, got {max_readers} and {slots}")
        self.wait_s = wait_s
        live = remove_dead_region(run_dir)
        if live:
            raise RuntimeError(f"a weight publisher (pid {live}) is already live for run_dir {run_dir}")
        self.path = _new_region_path()
        os.makedirs(run_dir, exist_ok=True)
        # recorded before the region exists, so that a publisher killed while creating it
        # leaves a name the next one can clean up
        atomic_write(os.path.join(run_dir, RECORD), f"{self.path}\n".encode(), durable=False, mode=0o600)
        self._region = _Region.create(self.path, self.header, slots, max_readers)
        # also at interpreter exit or garbage collection: readers learn the publisher is gone
        # and /dev/shm does not keep the region (a SIGKILLed learner's region is removed by
        # the next publisher of this run_dir instead)
        self._retire = weakref.finalize(self, _retire_own, self.path, self._region.ino, self._region.ctl)

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int | None:
        r = self._region
        try:
            s = self._claim()
            if s is None:
                log.warning("weight version %d not published: all %d slots are current or pinned by "
                            "readers %s", version, r.n_slots, self.readers())
                return None
            self._fill(s, named)
            with r.locked(self.wait_s):
                r.vers[s] = version
                r.ctl[W_CUR] = s
                r.ctl[W_LATEST] = version
        except _Busy:
            log.warning("weight version %d not published: the region lock stayed taken for %.2fs "
                        "(a stopped reader?)", version, self.wait_s)
            return None
        return r.payload

    def _fill(self, s: int, named: Mapping[str, torch.Tensor]) -> None:
        """Write the update into slot ``s``, which no reader can reach until it is published
        (weightsync.cuda_ipc writes device memory here, and only a record into the slot)."""
        r = self._region
        _copy_all(r.slot_views[s], [named[n] for n in r.names])

    def _claim(self) -> int | None:
        """A slot no reader can reach, marked as being written; None after ``wait_s`` without."""
        r = self._region
        deadline = time.monotonic() + self.wait_s
        while True:
            with r.locked(max(0.0, deadline - time.monotonic())):
                s = r.free_slot()
                if s is None and r.reap():
                    s = r.free_slot()
                if s is not None:
                    r.vers[s] = -1  # a crashed write never passes for a version
                    return s
            if time.monotonic() >= deadline:
                return None
            time.sleep(1e-3)

    def readers(self) -> list[tuple[int, int]]:
        """(pid, pinned slot or -1) of every attached reader, for diagnostics."""
        with self._region.locked(self.wait_s):
            return [(pid, pin) for pid, _, _, pin in self._region.table.tolist() if pid]

    @property
    def slots(self) -> int:
        return self._region.n_slots

    def _close(self) -> None:
        self._retire()
        self._region.close()


class ShmSubscriber(Subscriber):
    """Reads the region of ``run_dir``'s publisher; waits up to ``timeout_s`` for it to appear.

    ``apply(named)`` maps (``t.data = view of the slot``) every CPU target of the published
    dtype when ``zero_copy`` (the default) and copies into the rest. Mapping rebinds the given
    tensor objects: pass the model's own Parameters and buffers (``named_parameters()``), not
    ``state_dict()`` (detached aliases, whose rebinding the model would never see).
    If the publisher closes and a new one (a restarted learner) creates a region for the same
    run_dir, the subscriber moves to it on its next ``latest_version()``/``apply()``.
    ``lock_timeout_s`` bounds the wait for the region lock; past it ``apply`` returns None (the
    actor keeps its weights for now) and ``lock_timeouts`` counts it. ``stop`` (an Event or a
    callable) ends the wait for the publisher early with :class:`weightsync.base.Stopped`.
    A region another user owns or may write is refused with :class:`UnsafeRegion`.
    """

    transport = "shm"

    def __init__(self, run_dir: str, timeout_s: float = 60, *, zero_copy: bool = True,
                 lock_timeout_s: float = 1.0, stop=None):
        super().__init__()
        self.run_dir = run_dir
        self.zero_copy = zero_copy
        self.lock_timeout_s = lock_timeout_s
        self.lock_timeouts = 0
        self._next_reattach = 0.0
        self._region = wait_until(
            self._open_recorded, timeout_s,
            f"the weight publisher of run_dir {run_dir!r} (shared memory recorded in {RECORD}); is the learner up?",
            stop=stop,
        )

    @property
    def path(self) -> str:
        return self._region.path

    @property
    def header(self) -> WeightUpdateHeader:
        """The layout of the region it reads now (it may move to a restarted publisher's)."""
        return self._region.header

    def _open_recorded(self) -> _Region | None:
        path = region_path(self.run_dir)
        return None if path is None else _Region.open(path)

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
        path = region_path(self.run_dir)
        if path is None or path == self._region.path:
            return
        new = _Region.open(path)
        if new is not None:
            self._region.close()  # tensors mapped from it keep its memory until rebound
            self._region = new

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        self.latest_version()  # moves to a successor region if there is one
        r = self._region
        layout.check_targets(r.header, named, role="shm subscriber")
        if int(r.ctl[W_LATEST]) <= after:
            return None
        targets = [named[n] for n in r.names]
        maps = [self.zero_copy and t.device.type == "cpu" and t.dtype == v.dtype
                for t, v in zip(targets, r.slot_views[0])]
        try:
            with r.locked(self.lock_timeout_s):
                s = int(r.ctl[W_CUR])
                version = int(r.vers[s]) if s >= 0 else -1
                if version <= after:
                    return None
                r.table[r.entry, PIN] = s
                for t, view, m in zip(targets, r.slot_views[s], maps):
                    if m:
                        t.data = view
        except _Busy:
            self.lock_timeouts += 1
            return None
        n_mapped = sum(maps)
        if n_mapped < len(targets):
            _copy_all([t for t, m in zip(targets, maps) if not m],
                      [v for v, m in zip(r.slot_views[s], maps) if not m])
            if not n_mapped:
                self._unpin(r)
        self.stats.mapped = n_mapped
        return version, r.payload

    def _unpin(self, r: _Region) -> None:
        # on _Busy the pin stays, harmlessly: it moves at the next apply or goes at close
        with contextlib.suppress(_Busy):
            with r.locked(self.lock_timeout_s):
                r.table[r.entry, PIN] = -1

    def _close(self) -> None:
        self._region.close()
