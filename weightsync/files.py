"""Weights as versioned files (transports ``shm`` and ``filesystem``; the design: ARCHITECTURE.md, "Weights as versioned
files"): the kernel's ``rename``, open files and write leases (``F_SETLEASE``) do an allocator's work. A file is a
checksummed prefix and msgpack header (never pickle), then the page-aligned buckets."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import operator
import os
import re
import secrets
import stat
import struct
import time
import warnings
import weakref
from typing import Mapping

import crc32c
import msgspec
import torch

from core.files import atomic_write
from core.messages import DeltaHeader, FileHeader
from weightsync import delta, delta_plan, layout
from weightsync.base import Publisher, Subscriber, _Closable, wait_until

log = logging.getLogger(__name__)

PAGE = 4096
MAGIC, DELTA_MAGIC = b"DRFTWV01", b"DRFTWD01"  # a full version ``v<N>``, a delta ``d<N>`` (weightsync/delta.py)
# magic, version, payload crc32c (-1: none), header length, crc32c of the four fields before it and the header
_PREFIX = struct.Struct("<8sqqII")
LATEST = "LATEST"
RECORD = "weights.shm"  # in run_dir: the path of the shm transport's directory
_SHM_NAME = re.compile(r"driftrl-weights-[0-9a-f]{32}")
_OURS = re.compile(r"v\d+|d\d+(\.tmp\d+)?|\.?LATEST(-new|\.tmp\d+)?|\.(spare|new)-\d+")  # what a publisher may remove
_VERSION = re.compile(r"([vd])(\d+)")
_VANISHED_S = 30  # a reader gives up on versions retired between reading LATEST and opening them

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FileHeader)
_delta_decoder = msgspec.msgpack.Decoder(DeltaHeader)


class DamagedFile(ValueError):
    """A version file (or ``LATEST``) that is truncated, damaged or not a driftrl weights file."""


class UnsafeDirectory(PermissionError):
    """A weights directory (or its run_dir record) that another user owns or could read or write."""


def weights_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "weights")


def _shm_root(run_dir: str) -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.path.abspath(run_dir)


def _check_private(st: os.stat_result, path: str, is_dir: bool = False) -> None:
    """Refuse what another uid owns or group/other may use: the weights would be theirs to choose."""
    if not (stat.S_ISDIR if is_dir else stat.S_ISREG)(st.st_mode):
        raise UnsafeDirectory(f"refusing {path}: not a {'directory' if is_dir else 'regular file'}")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(f"refusing {path}: owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
    if st.st_mode & 0o077:
        raise UnsafeDirectory(f"refusing {path}: mode {st.st_mode & 0o777:04o} lets other users in "
                              f"(driftrl makes it {'0700' if is_dir else '0600'})")


def _private_dir(path: str | None) -> str | None:
    """``path`` if it is this user's private directory; None if it is None or does not exist (yet)."""
    if path is None:
        return None
    try:
        st = os.lstat(path)  # a symlink is refused, never followed
    except FileNotFoundError:
        return None
    _check_private(st, path, is_dir=True)
    return path


def recorded_dir(run_dir: str) -> str | None:
    """The shm directory recorded for ``run_dir``; None before the first publisher."""
    record = os.path.join(run_dir, RECORD)
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink someone put there
        raise UnsafeDirectory(f"refusing {record}: {e.strerror}") from None
    try:
        _check_private(os.fstat(fd), record)
        path = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if os.path.dirname(path) != _shm_root(run_dir) or not _SHM_NAME.fullmatch(os.path.basename(path)):
        raise UnsafeDirectory(f"refusing {record}: {path[:200]!r} is not a driftrl weights directory name")
    return path


def _lock_dir(path: str) -> int:
    """An fd holding ``path``'s flock for the publisher's life: a second live publisher is refused
    (RuntimeError) and remove_dead_region spares a live one."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_private(os.fstat(fd), path, is_dir=True)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"a weight publisher is already live for {path}") from None
    except UnsafeDirectory:
        os.close(fd)
        raise
    except OSError as e:  # a file system without flock (some NFS mounts): no guard, said once
        log.warning("no publisher lock on %s (%s): a second live publisher would go unnoticed", path, e.strerror)
    return fd


def _remove_files(path: str, only_ours: bool = False) -> int:
    """Unlink the files in ``path`` (a reader that maps one keeps its pages); how many went."""
    try:
        names = [n for n in os.listdir(path) if not only_ours or _OURS.fullmatch(n)]
    except FileNotFoundError:
        return 0
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))
    return len(names)


def _remove_shm_dir(run_dir: str, path: str) -> int:
    """Remove ``path`` with its files, and ``run_dir``'s record while it names ``path``."""
    removed = _remove_files(path)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    with contextlib.suppress(OSError):
        if recorded_dir(run_dir) == path:
            os.unlink(os.path.join(run_dir, RECORD))
    return removed


def remove_dead_region(run_dir: str, refuse_live: bool = False) -> int:
    """Remove ``run_dir``'s shm weights directory and record unless a live publisher holds it (how
    many files went): once the roles are gone, and by every new publisher, so /dev/shm keeps nothing."""
    try:
        path = recorded_dir(run_dir)
    except UnsafeDirectory as e:
        log.warning("ignoring the weights record: %s", e)  # the next publisher replaces it
        return 0
    if path is None:
        return 0
    try:
        with contextlib.suppress(FileNotFoundError):  # else only the record is left
            os.close(_lock_dir(path))  # a probe: a dead publisher holds no lock (closing drops ours)
    except RuntimeError:  # live
        if refuse_live:
            raise
        return 0
    except OSError:  # a symlink, a file, not ours to open, or not private
        log.warning("not touching %s: not this user's private directory", path)
        return 0
    return _remove_shm_dir(run_dir, path)


def _unshared(fd: int) -> bool | None:
    """Whether no other open file (or mapping), in any process, refers to ``fd``'s file: the kernel
    grants a write lease only then. None where leases are not supported."""
    if not hasattr(fcntl, "F_SETLEASE"):
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as e:
        return False if e.errno in (errno.EAGAIN, errno.EBUSY) else None
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


def _head(magic: bytes, version: int, payload_crc: int, raw: bytes) -> bytes:
    """A file's prefix (its own checksum over the fields and ``raw``) and the msgpack header ``raw``."""
    fields = _PREFIX.pack(magic, version, payload_crc, len(raw), 0)[8:-4]
    return magic + fields + struct.pack("<I", crc32c.crc32c(raw, crc32c.crc32c(fields))) + raw


def _read_head(fd: int, path: str, magic: bytes, version: int) -> tuple[int, bytes, int, int]:
    """Check a file's prefix and header checksum: ``(payload crc, raw header, where it ends, file size)``."""
    size = os.fstat(fd).st_size
    first = os.pread(fd, min(size, 1 << 16), 0)  # prefix and header at once, mostly
    if len(first) < _PREFIX.size:
        raise DamagedFile(f"{path}: truncated to {size} bytes, not even a header")
    got_magic, got_version, payload_crc, n, crc = _PREFIX.unpack_from(first)
    if got_magic != magic:
        raise DamagedFile(f"{path}: not a driftrl weights file of this kind (magic {got_magic!r})")
    end = _PREFIX.size + n
    raw = first[_PREFIX.size:end] if end <= len(first) else os.pread(fd, min(n, size), _PREFIX.size)
    if len(raw) != n or crc32c.crc32c(raw, crc32c.crc32c(first[8:_PREFIX.size - 4])) != crc:
        raise DamagedFile(f"{path}: damaged header (checksum mismatch)")
    if got_version != version:
        raise DamagedFile(f"{path}: holds version {got_version}, not {version}")
    return payload_crc, raw, end, size


class _File:
    """A file the publisher made: fd, size, name, ``index`` (kept when reused). Written with ``pwrite``, never mapped
    here: the version's pages stay in /dev/shm (or the page cache), out of the learner's resident memory."""

    def __init__(self, directory: str, index: int, size: int):
        self.name, self.index, self.size = f".new-{index}", index, size
        path = os.path.join(directory, self.name)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:  # the blocks now: a full /dev/shm (Docker's 64 MB) is a clear error, not a failed copy later
            os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            os.close(self.fd)
            os.unlink(path)
            raise OSError(e.errno, f"cannot reserve {size / 2**20:.0f} MiB for a weight version in {directory} "
                          f"({e.strerror}); enlarge it (Docker: --shm-size) or use weightsync.transport=filesystem"
                          ) from None

    def write(self, at: int, data) -> None:
        view = memoryview(data).cast("B")
        while view:  # a single write moves at most ~2 GiB
            n = os.pwrite(self.fd, view, at)
            view, at = view[n:], at + n

    def close(self) -> None:
        os.close(self.fd)


def _raw(t: torch.Tensor):
    """A tensor's bytes as a buffer (a view where it is a contiguous CPU tensor)."""
    return t.detach().cpu().reshape(-1).view(torch.uint8).numpy()


def _close_store(path: str, lock_fd: int, run_dir: str | None, visible: list, spares: list) -> None:
    """A publisher's close, also its finalizer; with ``run_dir`` (shm) it removes the directory and record."""
    for f in visible + spares:
        f.close()
    if run_dir is not None:
        _remove_shm_dir(run_dir, path)
    os.close(lock_fd)


class FilePublisher(Publisher):
    """``keep``: versions left visible; ``max_files``: files held at once (None: as many as readers
    keep open); a publish that would need more is skipped."""

    keep = 2
    recycle = True  # reuse a retired file nobody has open (never across hosts: a lease sees this one)
    durable = False  # fsync files and renames (another host reads them)
    checksum = False  # crc32c of the payload in the header: one more pass over the bytes
    owns_dir = True  # close() removes the directory (filesystem: the versions stay for late joiners)

    def __init__(self, run_dir: str, template: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20, *,
                 max_files: int | None = None):
        super().__init__(layout.header_for(-1, template, bucket_bytes))
        self.max_files = max_files
        widest = len(_encoder.encode(FileHeader(self.header, 2**62, 2**62, "0" * delta.EPOCH_CHARS)))
        self.payload_at = (_PREFIX.size + widest + PAGE - 1) // PAGE * PAGE  # the first page after any header
        self.visible: list[_File] = []  # oldest first
        self.deltas: list[str] = []  # the delta files since the newest full version
        self.spares: list[_File] = []
        self._made = 0
        self.dir = self._make_dir(run_dir)
        self._lock_fd = _lock_dir(self.dir)
        _remove_files(self.dir, only_ours=True)  # a previous publisher's versions (filesystem)
        # also at exit or GC (a SIGKILLed publisher's directory goes by remove_dead_region)
        self._finalizer = weakref.finalize(self, _close_store, self.dir, self._lock_fd,
                                           run_dir if self.owns_dir else None, self.visible, self.spares)

    def _write_delta(self, header: DeltaHeader, payload: torch.Tensor) -> int:
        """``d<version>``: a prefix, the msgpack header and the checksummed payload, written aside and renamed."""
        body, name = payload.cpu().numpy(), f"d{header.version}"
        head = _head(DELTA_MAGIC, header.version, crc32c.crc32c(body), _encoder.encode(header))
        atomic_write(os.path.join(self.dir, name), head + body.tobytes(), durable=self.durable, mode=0o600)
        self.deltas.append(name)
        self._point(name)
        return body.nbytes

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int | None:
        f = self._take()
        if f is None:
            log.warning("weight version %d not published: readers hold all %d files", version, self.max_files)
            return None
        crc = self._fill(f, named)
        epoch = self.delta.epoch if self.delta else ""  # every full version names the publisher of its deltas
        raw = _encoder.encode(FileHeader(self.header, self.payload_at, f.size, epoch))
        f.write(0, _head(MAGIC, version, crc, raw))
        if self.durable:
            os.fsync(f.fd)
        os.rename(os.path.join(self.dir, f.name), os.path.join(self.dir, f"v{version}"))
        f.name = f"v{version}"
        self.visible.append(f)
        self._point(f.name)
        while len(self.visible) > self.keep:
            self._retire(self.visible.pop(0))
        for name in self.deltas:  # a full version ends their chain (a reader that opened one keeps it)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, name))
        self.deltas.clear()
        return layout.payload_nbytes(self.header)

    def _take(self) -> _File | None:
        """A file no reader can reach: a spare nobody has open, else a new one (None past max_files)."""
        for f in (list(self.spares) if self.recycle else ()):
            free = _unshared(f.fd)
            if free is None:
                self._no_leases()
                break
            if free:
                self.spares.remove(f)
                return f
        if self.max_files is not None and len(self.visible) + len(self.spares) >= self.max_files:
            return None
        self._made += 1
        return _File(self.dir, self._made - 1, self.payload_at + layout.total_nbytes(self.header))

    def _no_leases(self) -> None:
        log.warning("%s: this file system grants no leases; every version gets a new file", self.dir)
        self.recycle = False
        for f in self.spares:
            self._discard(f)
        self.spares.clear()

    def _fill(self, f: _File, named: Mapping[str, torch.Tensor]) -> int:
        """Write the update into ``f``, which no reader can reach (cuda_ipc writes its record here); the payload's
        crc32c with ``checksum`` (its padding is zeros: never written), else -1."""
        crc, end = 0, 0
        for start, b in zip(layout.bucket_starts(self.header), self.header.buckets):
            for name, off in zip(b.names, b.offsets):
                data = _raw(named[name])
                if self.checksum:
                    crc = crc32c.crc32c(data, crc32c.crc32c(bytes(start + off - end), crc))
                f.write(self.payload_at + start + off, data)
                end = start + off + data.nbytes
        return crc32c.crc32c(bytes(layout.total_nbytes(self.header) - end), crc) if self.checksum else -1

    def _point(self, name: str) -> None:
        """``LATEST`` -> ``name`` (``v<N>`` or ``d<N>``): a symlink made aside and renamed over it (atomic)."""
        tmp = os.path.join(self.dir, ".LATEST-new")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a crashed publisher's
        os.symlink(name, tmp)
        os.replace(tmp, os.path.join(self.dir, LATEST))

    def _retire(self, f: _File) -> None:
        if not self.recycle:
            return self._discard(f)
        spare = f".spare-{f.index}"
        os.rename(os.path.join(self.dir, f.name), os.path.join(self.dir, spare))
        f.name = spare
        self.spares.append(f)

    def _discard(self, f: _File) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, f.name))  # a reader that maps it keeps its pages
        f.close()

    def _close(self) -> None:
        self._finalizer()


class ShmPublisher(FilePublisher):
    """Versions in a private directory in /dev/shm, reused files, no fsync, no payload checksum."""

    transport = "shm"

    @staticmethod
    def _make_dir(run_dir: str) -> str:
        """A new private directory in /dev/shm, recorded for ``run_dir`` (a dead predecessor's removed)."""
        remove_dead_region(run_dir, refuse_live=True)
        path = os.path.join(_shm_root(run_dir), f"driftrl-weights-{secrets.token_hex(16)}")
        os.makedirs(run_dir, exist_ok=True)
        # recorded before it exists: a publisher killed in between leaves a name the next one removes
        atomic_write(os.path.join(run_dir, RECORD), f"{path}\n".encode(), durable=False, mode=0o600)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            raise UnsafeDirectory(f"{path} already exists: someone else created this name; refusing to share it"
                                  ) from None
        os.chmod(path, 0o700)  # whatever the umask
        return path


class FsPublisher(FilePublisher):
    """For readers on other hosts: a new file per version, fsynced, checksummed, three kept, outliving close()."""

    transport = "filesystem"
    keep, recycle, durable, checksum, owns_dir = 3, False, True, True, False

    @staticmethod
    def _make_dir(run_dir: str) -> str:
        path = weights_dir(run_dir)
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            os.chmod(path, 0o700)  # also one made before this rule (or by the nccl transport)
        return path

    def _point(self, name: str) -> None:
        # a file, not a symlink: over NFS only an open revalidates a name another host replaced
        # (close-to-open); a readlink may see the old one for the attribute cache's 30-60 s
        atomic_write(os.path.join(self.dir, LATEST), f"{name}\n".encode(), mode=0o600)  # fsynced


class _Plan:
    """A reader's checked layout: ``tensors`` in payload order, (name, file offset, bytes, shape, element offset);
    each tensor's offset in the payload is a multiple of layout.ALIGN, so of every item size."""

    def __init__(self, raw: bytes, path: str, header_end: int):
        try:
            head = self.head = _decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise DamagedFile(f"{path}: unreadable header: {e}") from None
        if (head.payload_at % PAGE or head.payload_at < header_end
                or head.payload_at + layout.total_nbytes(head.layout) != head.file_bytes):
            raise DamagedFile(f"{path}: inconsistent header (payload at {head.payload_at}, {head.file_bytes} bytes)")
        h = self.layout = head.layout
        self.dtypes = {n: layout.torch_dtype(d) for n, d in zip(h.names, h.dtypes)}
        shapes = dict(zip(h.names, h.shapes))
        self.tensors = [(n, head.payload_at + start + off, layout.tensor_nbytes(b.dtype, shapes[n]), shapes[n],
                         (start + off) // layout.ITEMSIZE[b.dtype])
                        for start, b in zip(layout.bucket_starts(h), h.buckets) for n, off in zip(b.names, b.offsets)]


class _Binding:
    """Which targets of one dict are mapped (``zero_copy``, CPU, published dtype) and which read
    into; checked once, reused while the dict holds the same tensor objects."""

    def __init__(self, plan: _Plan, named: Mapping[str, torch.Tensor], zero_copy: bool, role: str):
        layout.check_targets(plan.layout, named, role=role)
        self.plan, self.named, self.values = plan, named, list(named.values())
        self.targets = [named[n] for n, *_ in plan.tensors]
        self.maps = [zero_copy and t.device.type == "cpu" and t.dtype == plan.dtypes[n]
                     for t, (n, *_) in zip(self.targets, plan.tensors)]

    def fits(self, plan: _Plan, named: Mapping[str, torch.Tensor]) -> bool:
        return (plan is self.plan and named is self.named and len(named) == len(self.values)
                and all(map(operator.is_, named.values(), self.values)))


class Version(_Closable):
    """One opened, checked version file: while it is open the publisher cannot reuse the file."""

    def __init__(self, path: str, fd: int, version: int, plan: _Plan, payload_crc: int):
        self.path, self.fd, self.version, self.plan, self.payload_crc = path, fd, version, plan, payload_crc

    @classmethod
    def open(cls, path: str, version: int, plans: dict) -> "Version | None":
        """The version at ``path``, checked (else DamagedFile); None if it is gone (retired: a newer
        one exists). A header is decoded once per publisher (``plans``, by its bytes)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            payload_crc, raw, end, size = _read_head(fd, path, MAGIC, version)
            if (plan := plans.get(raw)) is None:
                plans.clear()  # one publisher's at a time
                plan = plans[raw] = _Plan(raw, path, end)
            if size != plan.head.file_bytes:
                raise DamagedFile(f"{path}: {size} bytes, its header says {plan.head.file_bytes} "
                                  "(truncated or damaged)")
            return cls(path, fd, version, plan, payload_crc)
        except BaseException:
            os.close(fd)
            raise

    def verify(self, scratch) -> None:
        """Check the payload's crc32c (when the file has one) before any byte is used."""
        if self.payload_crc < 0:
            return
        head = self.plan.head
        buf, crc, pos = scratch(min(head.file_bytes - head.payload_at, 1 << 24)).numpy(), 0, head.payload_at
        while pos < head.file_bytes:
            n = os.preadv(self.fd, [buf[: head.file_bytes - pos]], pos)
            if n <= 0:
                raise DamagedFile(f"{self.path}: short read at byte {pos}")
            crc, pos = crc32c.crc32c(buf[:n], crc), pos + n
        if crc != self.payload_crc:
            raise DamagedFile(f"{self.path}: payload checksum mismatch (damaged)")

    def apply(self, bound: _Binding, scratch) -> int:
        """Read the unmapped targets, point the others at a read-only mapping of the file (no copy); how many."""
        plan, head = bound.plan, bound.plan.head
        for t, mapped, (n, off, nbytes, *_) in zip(bound.targets, bound.maps, plan.tensors):
            if not mapped and nbytes:
                self._read(t, plan.dtypes[n], off, nbytes, scratch)
        if not any(bound.maps):
            return 0
        mm = mmap.mmap(self.fd, head.file_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        # inference_mode(False): a parameter made an inference tensor could not be used outside it
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")  # read-only memory: an in-place write faults, never corrupts
            storage = torch.frombuffer(mm, dtype=torch.uint8, count=head.file_bytes - head.payload_at,
                                       offset=head.payload_at).untyped_storage()
            for t, mapped, (*_, shape, at) in zip(bound.targets, bound.maps, plan.tensors):
                if mapped:
                    t.set_(storage, at, shape)  # contiguous strides
        return sum(bound.maps)

    def _read(self, t: torch.Tensor, dtype: torch.dtype, off: int, nbytes: int, scratch) -> None:
        direct = t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
        stage = None if direct else scratch(nbytes)[:nbytes]
        dst = t.detach().reshape(-1).view(torch.uint8) if direct else stage
        if os.preadv(self.fd, [dst.numpy()], off) != nbytes:
            raise DamagedFile(f"{self.path}: short read at byte {off}")
        if stage is not None:
            t.copy_(stage.view(dtype).view(t.shape))

    def _close(self) -> None:
        os.close(self.fd)  # a mapping made by apply() keeps the file on its own


class DeltaFile(_Closable):
    """One opened, checked delta file ``d<N>`` (read whole: a delta is small)."""

    def __init__(self, path: str, head: DeltaHeader, payload: torch.Tensor):
        self.path, self.head, self.version, self.payload = path, head, head.version, payload

    @classmethod
    def open(cls, path: str, version: int) -> "DeltaFile | None":
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # retired: a full version followed
        try:
            payload_crc, raw, end, size = _read_head(fd, path, DELTA_MAGIC, version)
            body = bytearray(size - end)
            if os.preadv(fd, [body], end) != len(body) or crc32c.crc32c(body) != payload_crc:
                raise DamagedFile(f"{path}: payload checksum mismatch (damaged)")
            head = _delta_decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise DamagedFile(f"{path}: unreadable header: {e}") from None
        finally:
            os.close(fd)
        return cls(path, head, torch.frombuffer(body, dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8))

    def apply(self, bound: _Binding) -> int:
        """Write the changed elements into the reader's own tensors (never into a mapped file); payload bytes."""
        if any(bound.maps):
            raise ValueError(f"{self.path}: the publisher sends deltas, but this subscriber maps versions read-only "
                             "(zero_copy); make it copy (weightsync.delta decides both sides)")
        names = bound.plan.layout.names  # the publisher's order, not the payload's buckets
        try:
            delta.apply(self.head, self.payload, [bound.named[n] for n in names], [bound.plan.dtypes[n] for n in names])
        except ValueError as e:
            raise DamagedFile(f"{self.path}: {e}") from None
        return self.payload.numel()


class FileSubscriber(Subscriber):
    """``zero_copy``: map same-dtype CPU targets (rebinding the given tensor objects: pass the model's own
    Parameters, not ``state_dict()`` aliases); ``poll_s``: how often at most ``latest_version()`` reads
    ``LATEST``. A subclass finds the directory (``_find``: None until it exists; ``where``: where it looks)."""

    zero_copy, poll_s, where = True, 0.0, "?"
    _next_find = 0.0

    def __init__(self, run_dir: str, timeout_s: float = 60, *, zero_copy: bool | None = None,
                 poll_s: float | None = None, stop=None):
        super().__init__()
        self.run_dir = run_dir
        self.zero_copy = self.zero_copy if zero_copy is None else zero_copy
        self.poll_s = self.poll_s if poll_s is None else poll_s
        self._latest, self._checked_at = -1, -float("inf")
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._plans: dict[bytes, _Plan] = {}
        self._bound: _Binding | None = None
        self._kind, self._epoch = "v", ""  # LATEST's kind of file; the publisher whose weights this reader holds
        self.dir = wait_until(self._find, timeout_s, f"the weight publisher of run_dir {run_dir!r} "
                              f"({self.where}); is the learner up?", stop=stop)

    @classmethod
    def from_config(cls, cfg, run_dir: str, timeout_s: float, *, stop, device, actor_id: str) -> Subscriber:
        return cls(run_dir, timeout_s, stop=stop, zero_copy=False if delta_plan(cfg)[0] else None)

    def _moved(self) -> bool:
        """``LATEST`` missing: whether ``self.dir`` moved to a successor's (shm: a restarted learner's directory)."""
        now = time.monotonic()
        if now < self._next_find or os.path.isdir(self.dir):
            return False
        self._next_find = now + 0.5  # the publisher is gone: look for a successor, gently
        if (path := self._find()) is None or path == self.dir:
            return False
        self.dir = path
        return True

    @staticmethod
    def _pointer(path: str) -> str:
        return os.readlink(path)  # ``LATEST``'s target: a symlink read, never followed (one syscall)

    def latest_version(self) -> int:
        now = time.monotonic()
        if now - self._checked_at >= self.poll_s:
            self._checked_at = now
            got = self._read_latest()
            self._latest = self._latest if got is None else got
        return self._latest

    def _read_latest(self) -> int | None:
        path = os.path.join(self.dir, LATEST)
        try:
            target = self._pointer(path)
        except FileNotFoundError:  # nothing published yet, or the publisher closed
            return self._read_latest() if self._moved() else None
        except OSError as e:
            raise DamagedFile(f"{path}: not the pointer a publisher makes ({e.strerror})") from None
        if (m := _VERSION.fullmatch(target.strip())) is None:
            raise DamagedFile(f"{path}: points at {target[:60]!r}, not a version file")
        self._kind = m.group(1)
        return int(m.group(2))

    def open_newest(self, after: int) -> list | None:
        """What takes this reader from ``after`` to the newest version, opened and checked, oldest first: that
        version's file, the deltas since the version it holds, or a full version and the deltas after it."""
        deadline = time.monotonic() + _VANISHED_S
        while True:
            if (version := self._read_latest()) is None or version <= after:
                return None
            self._latest = version
            if self._kind == "d":
                got = self._chain(version, after)
            else:
                got = Version.open(os.path.join(self.dir, f"v{version}"), version, self._plans)
                got = None if got is None else [got]
            if got is not None:
                return got
            if time.monotonic() > deadline:  # retired between reading LATEST and opening it, again and again
                raise TimeoutError(f"{self.transport} subscriber: v{version} in {self.dir} vanished repeatedly")

    def _chain(self, version: int, after: int) -> list | None:
        """Deltas back from ``version`` to the one this reader holds, else to their full version; None if one
        vanished (a newer full version retired them) or belongs to another publisher (a restart)."""
        files, cur = [], DeltaFile.open(os.path.join(self.dir, f"d{version}"), version)
        while cur is not None and (not files or cur.head.epoch == files[0].head.epoch):
            files.append(cur)
            h = cur.head
            if h.base == after and h.epoch == self._epoch:
                return files[::-1]
            if h.base == h.full:
                full = Version.open(os.path.join(self.dir, f"v{h.full}"), h.full, self._plans)
                if full is None or full.plan.head.epoch == h.epoch:
                    return None if full is None else [full, *files[::-1]]
                full.close()  # another publisher's
                return None
            cur = DeltaFile.open(os.path.join(self.dir, f"d{h.base}"), h.base)
        return None

    def _scratch(self, nbytes: int) -> torch.Tensor:
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        if (files := self.open_newest(after)) is None:
            if self._plans:  # nothing newer, but tensors that cannot take the layout are an error now
                self._bind(next(iter(self._plans.values())), named)
            return None
        nbytes = 0
        with contextlib.ExitStack() as opened:
            for f in [opened.enter_context(x) for x in files]:  # all entered first, so all closed whatever happens
                if isinstance(f, DeltaFile):  # over what this reader holds: its binding's layout
                    nbytes += f.apply(self._bind(self._bound.plan, named))
                    continue
                bound = self._bind(f.plan, named)
                f.verify(self._scratch)
                self.stats.mapped = f.apply(bound, self._scratch)
                self._epoch, nbytes = f.plan.head.epoch, nbytes + layout.payload_nbytes(f.plan.layout)
        return files[-1].version, nbytes

    def _bind(self, plan: _Plan, named: Mapping[str, torch.Tensor]) -> _Binding:
        if self._bound is None or not self._bound.fits(plan, named):
            self._bound = _Binding(plan, named, self.zero_copy, f"{self.transport} subscriber")
        return self._bound

    def _close(self) -> None:
        self._staging, self._bound = torch.empty(0, dtype=torch.uint8), None


class ShmSubscriber(FileSubscriber):
    transport, where = "shm", f"a directory in /dev/shm recorded in {RECORD}"

    def _find(self) -> str | None:
        return _private_dir(recorded_dir(self.run_dir))


class FsSubscriber(FileSubscriber):
    """Copies (a mapping of a file on a network file system could fault once it is unlinked)."""

    transport, where = "filesystem", "no run_dir/weights yet"
    zero_copy, poll_s = False, 0.02

    @staticmethod
    def _pointer(path: str) -> str:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # an open: NFS revalidates the name
        try:
            return os.read(fd, 64).decode("ascii", "replace")
        finally:
            os.close(fd)

    def _find(self) -> str | None:
        return _private_dir(weights_dir(self.run_dir))
