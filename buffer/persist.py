"""Append-only segment log of the buffer, in ``run_dir/buffer/``.

Record = header ``<crc32 u32, length u32, kind u8>`` + payload; the crc covers length, kind and
payload, so a torn or corrupt record is recognised and ignored (and counted) on replay.

* ``GROUP``: the encoded RolloutGroup exactly as it came off the wire (no re-encoding).
* ``DONE``: msgpack ``[reason, [[actor_id, seq], ...]]`` -- consumed or dropped keys.
* ``SEEN``: msgpack snapshot of :class:`buffer.store.SeenKeys`; the first record of every
  segment, so the dedup memory survives the deletion of the segments before it.

A group's record is written (and, per ``fsync``, synced) before its ack leaves, so an acked
group survives a crash of the buffer. Replay rebuilds the resident set -- groups with no later
DONE record -- and the seen keys.

Durability is tracked as a log sequence number (LSN): ``written`` counts the bytes appended,
``durable`` how many of them are on disk per the ``fsync`` policy. The server tags every outgoing
message with the LSN it depends on (the end of its group's record for an ``ok`` ack or a batch,
everything written so far for the rest) and sends it once ``durable`` has reached it.

* ``always``: fsync after every record, inline (``durable == written`` at all times).
* ``batch``: group commit. :meth:`SegmentLog.commit` hands everything written so far to a
  flusher thread (``os.fsync`` releases the GIL); the server keeps receiving, validating and
  appending the next groups while the disk syncs, and each fsync covers every record written
  before it started -- one fsync per batch of acks, the batch being whatever arrived while the
  previous fsync ran. The flusher also closes rolled segments after their last fsync and syncs
  the directory after a segment is created, so a new file's name is durable with its records.
* ``never``: the page cache is trusted (survives a crash of the process, not of the machine);
  the same thread only closes rolled segments and deletes old ones, off the loop.

Disk stays bounded: segments roll at ``segment_bytes``. A sealed segment is deleted once none of
its groups is resident, none of its DONE records still cancels a group in a segment that
exists (else deleting it would resurrect that group on replay), and the SEEN snapshot opening the
next segment -- which remembers its keys from then on -- is durable. When long-lived groups pin many
old segments, :meth:`SegmentLog.maybe_compact` rewrites the resident set into one fresh segment
(temp file, fsync, rename) and deletes everything older.
"""

from __future__ import annotations

import contextlib

import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import msgspec

log = logging.getLogger("driftrl.buffer.persist")

HEADER = struct.Struct("<IIB")
GROUP, DONE, SEEN = 1, 2, 3
_LEN_KIND = struct.Struct("<IB")


def _crc(length: int, kind: int, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(_LEN_KIND.pack(length, kind)))


def encode_record(kind: int, payload) -> bytes:
    n = len(payload)
    return HEADER.pack(_crc(n, kind, payload), n, kind)


def iter_records(data: bytes):
    """Yield ``(offset_after, kind, payload_view)``; stops at the first torn/corrupt record."""
    mv = memoryview(data)
    pos = 0
    while pos + HEADER.size <= len(data):
        crc, n, kind = HEADER.unpack_from(data, pos)
        start, end = pos + HEADER.size, pos + HEADER.size + n
        if end > len(data) or kind not in (GROUP, DONE, SEEN):
            return
        payload = mv[start:end]
        if _crc(n, kind, payload) != crc:
            return
        pos = end
        yield pos, kind, payload


def _write_all(fd: int, header: bytes, payload) -> None:
    """One writev for header + payload (no concatenation copy), finishing a short write."""
    n = os.writev(fd, [header, payload])
    total = len(header) + len(payload)
    if n < total:  # rare (signal, huge record): write what is left
        rest = memoryview(header + bytes(payload))[n:]
        while rest:
            rest = rest[os.write(fd, rest):]


@dataclass
class Segment:
    num: int
    path: str
    size: int = 0
    live: int = 0  # resident groups whose (latest) record is here
    refs: set = field(default_factory=set)  # older segments whose groups DONE records here cancel
    snap_lsn: int = 0  # LSN just after this segment's SEEN record (0: on disk already)


@dataclass
class Replay:
    groups: dict  # key -> raw bytes, resident at the crash, in arrival order
    seen: list  # SEEN snapshots found, oldest first
    done_keys: list  # keys from DONE records (they were seen too)
    corrupt: int  # segments whose tail was torn/corrupt


_fsync = os.fsync  # the one way this module syncs: tests gate it to see what waits for the disk


def _fsync_dir(path: str) -> None:
    dfd = os.open(path, os.O_RDONLY)
    try:
        _fsync(dfd)
    finally:
        os.close(dfd)


class _Flusher:
    """Group commit for ``fsync = batch``: a thread that fsyncs what the loop has written.
    With ``sync=False`` (``fsync = never``) it only closes rolled segments and deletes old ones.

    The loop appends and calls :meth:`request` with its LSN; the flusher fsyncs every fd holding
    requested bytes, publishes ``durable`` and writes a byte to ``wake_fd`` so the loop's poller
    wakes to release what waited for it. A rolled segment's fd is handed over (:meth:`switch`),
    never closed by the loop, so no fd is closed under a running fsync. Deleting a segment
    (:meth:`unlink`, ~5 ms for 16 MB here) happens here too, off the loop. A failed fsync is fatal
    (the kernel may have dropped the dirty pages): it is kept in ``error`` and re-raised by
    :meth:`check` in the loop, which then stops the server the way an inline fsync error would.
    """

    def __init__(self, directory: str, sync: bool = True):
        self.dir, self.sync = directory, sync
        self.durable = 0
        self.error: OSError | None = None
        self._cond = threading.Condition()
        self._target = 0
        self._fd = -1
        self._sealed: list[int] = []
        self._unlink: list[str] = []
        self._dir_dirty = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, fd: int, durable: int) -> None:
        self._fd, self._stop = fd, False
        self.durable = self._target = durable
        self._thread = threading.Thread(target=self._run, name="buffer-fsync", daemon=True)
        self._thread.start()

    def switch(self, fd: int) -> None:
        """The loop rolled to a new segment: sync and close the old fd, sync the directory."""
        with self._cond:
            self._sealed.append(self._fd)
            self._fd, self._dir_dirty = fd, True
            self._cond.notify()

    def unlink(self, path: str) -> None:
        with self._cond:
            self._unlink.append(path)
            self._cond.notify()

    def request(self, lsn: int) -> None:
        with self._cond:
            if lsn > self._target:
                self._target = lsn
                self._cond.notify()

    def wait(self, lsn: int) -> None:
        with self._cond:
            while self.durable < lsn and self.error is None:
                self._cond.wait()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self, lsn: int) -> int:
        """Sync up to ``lsn``, close the handed-over fds, end the thread; returns the active fd."""
        self.request(lsn)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        self._thread = None
        return self._fd

    def close(self) -> None:
        for fd in (self.wake_fd, self._wake_w):
            os.close(fd)

    def drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # nothing pending: nothing to drain
            os.read(self.wake_fd, 4096)

    def _pending(self) -> bool:
        return self._target > self.durable or bool(self._sealed) or self._dir_dirty or bool(self._unlink)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._pending() or self._stop):
                    self._cond.wait()
                if not self._pending():
                    return
                # one consistent view: every byte up to target is in a sealed fd or the active one
                target, sealed, fd, dir_dirty = self._target, self._sealed, self._fd, self._dir_dirty
                unlink, self._unlink = self._unlink, []
                self._sealed, self._dir_dirty = [], False
            try:
                for old in sealed:
                    if self.sync:
                        _fsync(old)
                    os.close(old)
                if self.sync and target > self.durable:
                    _fsync(fd)
                if self.sync and dir_dirty:
                    _fsync_dir(self.dir)
                for path in unlink:  # in gc() order: the invariants of a synchronous gc() hold
                    os.unlink(path)
            except OSError as e:
                with self._cond:
                    self.error = e
                    self._cond.notify_all()
                self._wake()
                return
            with self._cond:
                self.durable = target
                self._cond.notify_all()
            if self.sync:
                self._wake()

    def _wake(self) -> None:
        # a full pipe means the loop has wake-ups pending anyway
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")


class SegmentLog:
    def __init__(self, directory: str, segment_bytes: int, fsync: str = "batch"):
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"buffer.fsync must be always|batch|never, got {fsync!r}")
        self.dir = directory
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.segments: dict[int, Segment] = {}
        self.loc: dict = {}  # resident key -> segment number holding its record
        self.live_bytes = 0
        self._sizes: dict = {}  # resident key -> record size on disk
        self.active: Segment | None = None
        self._fd = -1
        self.written = 0  # LSN: bytes appended since open()
        # always: every record is synced inline, so a roll must sync the new file inline too
        self._flusher = None if fsync == "always" else _Flusher(directory, sync=fsync == "batch")
        self.compactions = 0
        os.makedirs(directory, exist_ok=True)

    @property
    def durable(self) -> int:
        """The LSN up to which records are durable per the fsync policy."""
        return self._flusher.durable if self.fsync == "batch" and self._flusher else self.written

    @property
    def wake_fd(self) -> int | None:
        """Readable after each background fsync (``batch``): poll it to release what waited."""
        return self._flusher.wake_fd if self.fsync == "batch" and self._flusher else None

    def drain_wake(self) -> None:
        if self._flusher is not None:
            self._flusher.drain_wake()

    # ---- replay ------------------------------------------------------------------------------

    def _paths(self) -> list[tuple[int, str]]:
        out = []
        for name in os.listdir(self.dir):
            if name.endswith(".tmp"):  # an interrupted compaction: the originals are intact
                os.unlink(os.path.join(self.dir, name))
            elif name.startswith("seg-") and name.endswith(".log"):
                out.append((int(name[4:-4]), os.path.join(self.dir, name)))
        return sorted(out)

    def replay(self) -> Replay:
        """Read every segment; rebuild which groups are resident and where their records are."""
        groups: dict = {}
        seen, done_keys, corrupt = [], [], 0
        for num, path in self._paths():
            seg = self.segments[num] = Segment(num, path)
            with open(path, "rb") as f:
                data = f.read()
            end = 0
            for end, kind, payload in iter_records(data):
                if kind == GROUP:
                    key = _group_key(payload)
                    if key is None:
                        continue
                    groups.pop(key, None)  # a compaction copy supersedes the original
                    groups[key] = bytes(payload)
                    self._place(key, seg, HEADER.size + len(payload))
                elif kind == DONE:
                    _reason, keys = msgspec.msgpack.decode(payload)
                    keys = [(a, s) for a, s in keys]
                    for key in keys:
                        groups.pop(key, None)
                    self._cancel(keys, seg)
                    done_keys.extend(keys)
                else:
                    seen.append(msgspec.msgpack.decode(payload))
            seg.size = end
            if end < len(data):
                corrupt += 1
                log.warning("segment %s: ignoring %d torn/corrupt bytes at offset %d",
                            path, len(data) - end, end)
                os.truncate(path, end)
        return Replay(groups, seen, done_keys, corrupt)

    # ---- writing -----------------------------------------------------------------------------

    def open(self, snapshot: Callable[[], dict]) -> None:
        """Start a fresh segment (always, after replay: never append after a torn tail)."""
        self._snapshot = snapshot
        self._roll()
        if self._flusher is not None:
            self._flusher.start(self._fd, self.written)
        self.gc()

    def make_room(self, nbytes: int) -> None:
        """Roll now if a record of ``nbytes`` would not fit the active segment.

        The server calls this before it marks a group's key seen: the new segment's SEEN
        snapshot must not remember a key whose record comes after it (a power loss between the
        two would leave the key seen with no record, and its resend answered ``duplicate``).
        """
        if self.active.size > 0 and self.active.size + HEADER.size + nbytes > self.segment_bytes:
            self._roll()

    def append_group(self, key, raw) -> None:
        self.make_room(len(raw))
        self._write(GROUP, raw)
        self._place(key, self.active, HEADER.size + len(raw))

    def append_done(self, keys: list, reason: str) -> None:
        if not keys:
            return
        self._write(DONE, msgspec.msgpack.encode([reason, keys]))
        self._cancel(keys, self.active)

    def commit(self, wait: bool = True) -> None:
        """Make everything written so far durable; ``wait=False`` (the server loop, ``batch``)
        only hands it to the flusher and returns: watch ``durable`` / ``wake_fd``."""
        if self.fsync != "batch":  # always: synced record by record; never: nothing to do
            return
        self._flusher.check()
        self._flusher.request(self.written)
        if wait:
            self._flusher.wait(self.written)

    def close(self) -> None:
        failed = False
        if self._flusher is not None:
            if self._flusher.running:
                self._fd = self._flusher.stop(self.written)
            failed = self._flusher.error is not None
            self._flusher.close()
            self._flusher = None
        self._close_fd(sync=not failed)

    def _close_fd(self, sync: bool = True) -> None:
        if self._fd >= 0:
            if sync and self.fsync != "never":
                _fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    @property
    def disk_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    def _write(self, kind: int, payload) -> None:
        _write_all(self._fd, encode_record(kind, payload), payload)
        size = HEADER.size + len(payload)
        self.active.size += size
        if self.fsync == "always":
            _fsync(self._fd)
        self.written += size

    def _place(self, key, seg: Segment, size: int) -> None:
        old = self.loc.get(key)
        if old is not None:  # replay of a compaction copy
            self.segments[old].live -= 1
            self.live_bytes -= self._sizes[key]
        self.loc[key] = seg.num
        self._sizes[key] = size
        seg.live += 1
        self.live_bytes += size

    def _cancel(self, keys, seg: Segment) -> None:
        for key in keys:
            origin = self.loc.pop(key, None)
            if origin is None:
                continue
            self.live_bytes -= self._sizes.pop(key)
            self.segments[origin].live -= 1
            if origin != seg.num:
                seg.refs.add(origin)

    def _roll(self) -> None:
        num = max(self.segments, default=0) + 1
        seg = Segment(num, self._seg_path(num))
        fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        background = self._flusher is not None and self._flusher.running
        if background:
            self._flusher.switch(fd)  # it syncs (batch) and closes the old segment
        else:
            self._close_fd()
        self.active = self.segments[num] = seg
        self._fd = fd
        self._write(SEEN, msgspec.msgpack.encode(self._snapshot()))
        seg.snap_lsn = self.written
        # the snapshot is what lets older segments go: gc() deletes none before it is durable
        if not background:
            self._sync_new_file()
        elif self.fsync == "batch":
            self._flusher.request(self.written)

    def _seg_path(self, num: int) -> str:
        return os.path.join(self.dir, f"seg-{num:08d}.log")

    def _sync_new_file(self) -> None:
        if self.fsync == "never":
            return
        _fsync(self._fd)
        _fsync_dir(self.dir)

    # ---- bounding the disk -------------------------------------------------------------------

    def gc(self) -> int:
        """Delete sealed segments that hold nothing a replay would need; returns how many."""
        removed, durable = 0, self.durable
        nums = sorted(self.segments)
        for i, num in enumerate(nums):
            seg = self.segments[num]
            if seg is self.active or seg.live > 0 or any(r in self.segments for r in seg.refs):
                continue
            if self.segments[nums[i + 1]].snap_lsn > durable:
                break  # its keys are remembered only by a snapshot not yet on disk (nor later ones)
            if self._flusher is not None and self._flusher.running:
                self._flusher.unlink(seg.path)
            else:
                os.unlink(seg.path)
            del self.segments[num]
            removed += 1
        return removed

    def maybe_compact(self, resident: Callable[[], Iterable[tuple]]) -> bool:
        """Rewrite the resident groups into one fresh segment when old segments pile up.

        Trigger: disk use above twice the live record bytes plus two segments, with more than
        two segments. Each rewrite copies at most the live bytes, and happens only after the
        disk has grown by more than that, so the write amplification stays below 2x.
        """
        self.gc()
        if len(self.segments) <= 2 or \
                self.disk_bytes <= 2 * self.live_bytes + 2 * self.segment_bytes:
            return False
        self.compact(resident)
        return True

    def compact(self, resident: Callable[[], Iterable[tuple]]) -> None:
        background = self._flusher is not None and self._flusher.running
        if background:  # rare: do it synchronously, with every earlier record already on disk
            self._fd = self._flusher.stop(self.written)
        num = max(self.segments) + 1
        path = self._seg_path(num)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        new = Segment(num, path)
        placed = []
        try:
            for kind, key, payload in self._compact_records(resident):
                _write_all(fd, encode_record(kind, payload), payload)
                new.size += HEADER.size + len(payload)
                if kind == GROUP:
                    placed.append((key, HEADER.size + len(payload)))
            if self.fsync != "never":
                _fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._close_fd()
        old = list(self.segments.values())
        self.segments = {num: new}
        self.loc.clear()
        self._sizes.clear()
        self.live_bytes = 0
        for key, size in placed:
            self._place(key, new, size)
        self.active = new
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._sync_new_file()  # the rename is durable before the originals go
        for seg in old:
            os.unlink(seg.path)
        if background:
            self._flusher.start(self._fd, self.written)
        self.compactions += 1
        log.info("compacted %d segments into %s (%d resident groups)", len(old), path, len(placed))

    def _compact_records(self, resident):
        yield SEEN, None, msgspec.msgpack.encode(self._snapshot())
        for key, raw in resident():
            yield GROUP, key, raw


_HEAD = msgspec.msgpack.Decoder(tuple)


def _group_key(payload):
    """(actor_id, seq) of an encoded RolloutGroup without decoding its arrays."""
    try:
        # array_like + tagged: ["group", actor_id, seq, ...]; msgspec must parse the whole
        # array, but bytes fields are cheap to skip compared with building the Struct
        head = _HEAD.decode(payload)
        return (head[1], head[2])
    except (msgspec.DecodeError, IndexError):
        return None
