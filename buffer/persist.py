"""Append-only segment log of the buffer, in ``run_dir/buffer/``.

Record = header ``<hcrc u32, pcrc u32, length u32, kind u8, seg u32>`` + payload. ``pcrc`` is the
crc32c of the payload, ``hcrc`` that of the rest of the header, and ``seg`` the number of the
segment the record was written into. Segment files are recycled (below), so a file holds, after
this life's records, whatever an earlier life left there: replay reads records while their
header is intact, carries this segment's number and their payload checks, and then judges what
stops it:

* the end of the file, or -- in a recycled file -- bytes of an earlier life: the end;
* a torn tail, the last write cut short by a crash: a header cut short, a record longer than the
  rest of the file, a tail of zeros, or (in a recycled file only, where a cut write leaves the
  old bytes after it) a record that fails its crc with nothing of this life after it. Nothing in
  it was acknowledged (an ack waits for the whole record to be durable); it is cut off and
  counted (``torn``);
* anything else is corruption -- a complete record that fails its crc in a file created for its
  segment, or damage followed by intact records of this life: replay raises
  :class:`CorruptLog` naming the file and byte offset, and the buffer refuses to start rather
  than drop acknowledged groups (or revive consumed ones) silently. Recovery:
  ``python -m buffer.persist --salvage RUN_DIR/buffer`` (:func:`salvage`) keeps every intact
  record, moves the damaged file to ``damaged/`` and reports what was lost.

The one case replay cannot tell apart: the last record of this life in a recycled file failing
its crc with nothing after it reads exactly like a write cut short over the old bytes, and is
treated as torn.

* ``GROUP``: the encoded RolloutGroup exactly as it came off the wire (no re-encoding).
* ``DONE``: msgpack ``[reason, [[actor_id, seq], ...]]`` -- consumed or dropped keys.
* ``SEEN`` / ``SEEN_NEW``: msgpack snapshot of :class:`buffer.store.SeenKeys`; the first record
  of every segment, so the dedup memory survives the deletion of the segments before it.
  ``SEEN_NEW`` opens a file created for its segment (nothing but this life can follow),
  ``SEEN`` a recycled one.

A group's record is written (and, per ``fsync``, synced) before its ack leaves, so an acked
group survives a crash of the buffer. Replay rebuilds the resident set -- groups with no later
DONE record -- and the seen keys.

Durability is tracked as a log sequence number (LSN): ``written`` counts the bytes appended (given
to the log), ``durable`` how many of them are in the file and, per the ``fsync`` policy, on disk.
The server tags every outgoing message with the LSN it depends on (the end of its group's record
for an ``ok`` ack or a batch, everything appended so far for the rest) and sends it once
``durable`` has reached it.

* ``always``: write and fsync every record inline (``durable == written`` at all times).
* ``batch``: group commit. Records go to an I/O thread (:class:`_Flusher`) that writes them in
  order (one writev per round) and fsyncs (``os.writev``/``os.fsync`` release the GIL): the server keeps receiving,
  validating and appending the next groups meanwhile, and each fsync covers every record written
  before it started -- one fsync per batch of acks, the batch being whatever arrived while the
  previous one ran. The thread also closes rolled segments after their last fsync and syncs
  the directory after a segment is created, so a new file's name is durable with its records.
* ``never``: the same thread writes, and the page cache is trusted (it survives a crash of the
  process, not of the machine).

Disk stays bounded: segments roll at ``segment_bytes``. A deleted segment's file goes to a small
pool of free files (``free-*.log``) that the next roll renames and overwrites from the start:
its pages are still in the page cache, so writing a 100 KB record costs a memcpy instead of
allocating fresh pages (~5x cheaper here). The rename is made durable before any record in
the file is acknowledged, like a new file's name. A sealed segment is deleted once none of
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
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

import crc32c
import msgspec

from core.files import atomic_write, fsync_path
from core.messages import group_key

log = logging.getLogger("driftrl.buffer.persist")

HEADER = struct.Struct("<IIIBI")  # hcrc, pcrc, length, kind, seg
_REST = struct.Struct("<IIBI")  # what hcrc covers: pcrc, length, kind, seg
GROUP, DONE, SEEN, SEEN_NEW = 1, 2, 3, 4
KINDS = (GROUP, DONE, SEEN, SEEN_NEW)
SEEN_KINDS = (SEEN, SEEN_NEW)
_KIND_AT = HEADER.size - 5  # offset of the kind byte (followed by seg) in a header
FREE_FILES = 4  # deleted segments kept for reuse
IOV_MAX = 1024  # buffers one writev takes (Linux)
_crc = crc32c.crc32c


def encode_record(kind: int, payload, seg: int) -> bytes:
    """The header of ``payload`` in segment ``seg``."""
    rest = _REST.pack(_crc(payload), len(payload), kind, seg)
    return struct.pack("<I", _crc(rest)) + rest


class CorruptLog(RuntimeError):
    """A segment holds damage that is not a torn tail (see the module docstring)."""

    def __init__(self, path: str, offset: int):
        directory = os.path.dirname(path)
        super().__init__(
            f"buffer segment log damaged: {path} at byte {offset} (a record that fails its checksum, "
            "or damage followed by intact records). The buffer will not start on it: acknowledged "
            "groups would be lost and consumed ones revived without a word. With the run stopped, "
            f"run `python -m buffer.persist --salvage {directory}` (keeps every intact record, moves "
            "the damaged file aside, reports what was lost), then start again.")
        self.path, self.offset = path, offset


def parse_header(data, pos: int, seg: int | None):
    """``(pcrc, length, kind, seg)`` of an intact header of segment ``seg`` at ``pos``, else None."""
    if pos + HEADER.size > len(data):
        return None
    hcrc, pcrc, n, kind, s = HEADER.unpack_from(data, pos)
    if _crc(memoryview(data)[pos + 4:pos + HEADER.size]) != hcrc or kind not in KINDS:
        return None
    if seg is not None and s != seg:
        return None  # a record of the file's earlier life
    return pcrc, n, kind, s


def _records(data, pos: int, seg: int | None) -> tuple[list, int]:
    """The run of intact records of segment ``seg`` from ``pos``: ``([(offset_after, kind,
    payload_view)], where the run stops)``. ``seg=None``: the first record's segment."""
    mv = memoryview(data)
    out = []
    while True:
        h = parse_header(data, pos, seg)
        if h is None:
            return out, pos
        pcrc, n, kind, seg = h
        end = pos + HEADER.size + n
        if end > len(data) or _crc(mv[pos + HEADER.size:end]) != pcrc:
            return out, pos
        out.append((end, kind, mv[pos + HEADER.size:end]))
        pos = end


def _record_at(data, pos: int, seg: int) -> bool:
    h = parse_header(data, pos, seg)
    if h is None:
        return False
    end = pos + HEADER.size + h[1]
    return end <= len(data) and _crc(memoryview(data)[pos + HEADER.size:end]) == h[0]


def _resync(data, start: int, seg: int) -> int | None:
    """Offset of the first intact record of segment ``seg`` at or after ``start``, else None.
    Only offsets whose kind and segment bytes match are checked: ``bytes.find`` skips the rest."""
    tail = struct.pack("<I", seg)
    nexts = {k: data.find(bytes([k]) + tail, start + _KIND_AT) for k in KINDS}
    while True:
        hits = [i for i in nexts.values() if i >= 0]
        if not hits:
            return None
        i = min(hits)
        if _record_at(data, i - _KIND_AT, seg):
            return i - _KIND_AT
        for k, j in nexts.items():
            if j == i:
                nexts[k] = data.find(bytes([k]) + tail, i + 1)


def _verdict(data, pos: int, seg: int, fresh: bool) -> str | None:
    """What stopped the scan at ``pos``: None (the end), "torn" or "corrupt" (module docstring)."""
    rest = len(data) - pos
    if rest == 0:
        return None
    h = parse_header(data, pos, seg)
    if rest < HEADER.size or (h is not None and pos + HEADER.size + h[1] > len(data)):
        return "torn"  # a header, or a record, cut short by the end of the file
    if data.count(b"\0", pos) == rest:
        return "torn"  # allocated, never written (a power loss before the data reached the disk)
    if _resync(data, pos + 1, seg) is not None:
        return "corrupt"  # damage with intact records of this life after it
    if fresh:
        return "corrupt"  # no earlier life in this file to explain the bytes
    # recycled: an earlier life's bytes (h is None) or a write cut short over them
    return "torn" if h is not None else None


def scan(data, seg: int | None = None):
    """``(records, end, verdict)``: ``records`` = ``[(offset_after, kind, payload_view)]`` of this
    life, in order, up to ``end``; ``verdict`` is None (clean end), "torn" or "corrupt" (see the
    module docstring). ``seg=None`` takes the segment number from the first record."""
    records, end = _records(data, 0, seg)
    if seg is None:
        seg = parse_header(data, 0, None)[3] if records else 0
    fresh = bool(records) and records[0][1] == SEEN_NEW
    return records, end, _verdict(data, end, seg, fresh)


def _write_all(fd: int, bufs: list) -> None:
    """Write ``bufs`` back to back in as few writev calls as the kernel takes (no concatenation
    copy), finishing a short write."""
    for i in range(0, len(bufs), IOV_MAX):
        chunk = bufs[i:i + IOV_MAX]
        n = os.writev(fd, chunk)
        if n < sum(map(len, chunk)):  # rare (a signal, a huge batch): write what is left
            rest = memoryview(b"".join(chunk))[n:]
            while rest:
                rest = rest[os.write(fd, rest):]


def _by_fd(writes: list[tuple]) -> list[tuple[int, list]]:
    """The queued ``(fd, header, payload, lsn)`` writes as one buffer list per run of one fd."""
    out: list[tuple[int, list]] = []
    for fd, header, payload, _ in writes:
        if not out or out[-1][0] != fd:
            out.append((fd, []))
        out[-1][1].extend((header, payload))
    return out


@dataclass
class Segment:
    num: int
    path: str
    size: int = 0  # bytes of this life's records
    alloc: int = 0  # size of the file (a recycled file is larger than what it holds yet)
    live: int = 0  # resident groups whose (latest) record is here
    refs: set = field(default_factory=set)  # older segments whose groups DONE records here cancel
    snap_lsn: int = 0  # LSN just after this segment's SEEN record (0: on disk already)


@dataclass
class Replay:
    groups: dict  # key -> raw bytes, resident at the crash, in arrival order
    seen: list  # SEEN snapshots found, oldest first
    done_keys: list  # keys from DONE records (they were seen too)
    torn: int  # segments whose last record was torn (cut off)


# how this module syncs segment files: tests gate it to see what waits for the disk. fdatasync:
# the data and what is needed to read it back (a grown size), without the mtime; a recycled
# segment does not grow, so its syncs write no inode and commit no journal transaction
_fsync = os.fdatasync


class _FreePool:
    """Files of deleted segments, kept for reuse (see the module docstring). Thread-safe: the
    flusher retires files into it, the loop takes them when it rolls."""

    def __init__(self, directory: str):
        self.dir = directory
        self._lock = threading.Lock()
        self.files: list[str] = []

    def adopt(self, path: str) -> None:
        with self._lock:
            if len(self.files) < FREE_FILES:
                self.files.append(path)
                return
        os.unlink(path)

    def take(self) -> str | None:
        with self._lock:
            return self.files.pop() if self.files else None

    def retire(self, path: str) -> None:
        with self._lock:
            keep = len(self.files) < FREE_FILES
        # a fresh name: a counter would collide with free files an earlier incarnation left
        name = os.path.join(self.dir, f"free-{uuid.uuid4().hex}.log")
        if not keep:
            os.unlink(path)
            return
        os.rename(path, name)
        with self._lock:
            self.files.append(name)

    def nbytes(self) -> int:
        with self._lock:
            files = list(self.files)
        return sum(os.path.getsize(f) for f in files if os.path.exists(f))


class _Flusher:
    """The log's I/O thread (``fsync`` = batch or never): it writes the records the loop queues,
    in order, then -- ``batch`` -- fsyncs them (group commit), closes rolled segments and retires
    deleted ones, all off the loop.

    The loop assigns each record its LSN and queues it (:meth:`write`); ``os.writev`` and
    ``os.fsync`` release the GIL, so the copy into the page cache and the sync overlap the
    loop's receiving and validating the next groups. ``written`` is the LSN up to which records
    are in the page cache, ``durable`` the one up to which they are durable per the policy
    (``never``: the same). After each round the thread writes a byte to ``wake_fd`` so the
    loop's poller wakes to release what waited for it. A queued payload is the received frame
    itself, kept alive by the write queue until it is written. A rolled segment's fd is handed
    over (:meth:`switch`), never closed by the loop, so no fd is closed under a running write or
    fsync. Deleting a segment
    (:meth:`unlink`, ~5 ms for 16 MB here) happens here too. A failed write or fsync is fatal
    (the kernel may have dropped the dirty pages): it is kept in ``error`` and re-raised by
    :meth:`check` in the loop, which then stops the server the way an inline error would.
    """

    def __init__(self, directory: str, pool: _FreePool, sync: bool = True):
        self.dir, self.sync, self.pool = directory, sync, pool
        self.durable = self.written = 0
        self.error: OSError | None = None
        self._cond = threading.Condition()
        self._target = 0
        self._fd = -1
        self._writes: list[tuple] = []  # (fd, header, payload, lsn after it), in LSN order
        self._queued = 0  # LSN after the last queued write
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

    def start(self, fd: int, lsn: int) -> None:
        """Take over ``fd`` with everything up to ``lsn`` already written (and synced, if due)."""
        self._fd, self._stop = fd, False
        self.durable = self.written = self._target = self._queued = lsn
        self._thread = threading.Thread(target=self._run, name="buffer-log-io", daemon=True)
        self._thread.start()

    def write(self, fd: int, header: bytes, payload, lsn: int) -> None:
        with self._cond:
            self._writes.append((fd, header, payload, lsn))
            self._queued = lsn
            self._cond.notify()

    def switch(self, fd: int) -> None:
        """The loop rolled to a new segment: sync and close the old fd, sync the directory."""
        with self._cond:
            self._sealed.append(self._fd)
            self._fd, self._dir_dirty = fd, True
            self._cond.notify()

    def unlink(self, path: str) -> None:
        """Retire a deleted segment: into the free pool (renamed) or, when it is full, unlinked."""
        with self._cond:
            self._unlink.append(path)
            self._cond.notify()

    def request(self, lsn: int) -> None:
        with self._cond:
            if lsn > self._target:
                self._target = lsn
                self._cond.notify()

    def wait(self, lsn: int) -> None:
        """Block until ``lsn`` is durable."""
        with self._cond:
            while self.durable < lsn and self.error is None:
                self._cond.wait()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self, lsn: int) -> int:
        """Write and sync up to ``lsn``, close the handed-over fds, end the thread; returns the
        active fd."""
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
        self.wake_fd = self._wake_w = -1

    def drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # nothing pending: nothing to drain
            os.read(self.wake_fd, 4096)

    def _pending(self) -> bool:
        return bool(self._writes) or (self.sync and self._target > self.durable) or \
            bool(self._sealed) or self._dir_dirty or bool(self._unlink)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._pending() or self._stop):
                    self._cond.wait()
                if not self._pending():
                    return
                # one consistent view: every byte queued so far is in a sealed fd or the active one
                writes, self._writes = self._writes, []
                target, sealed, fd, dir_dirty = self._target, self._sealed, self._fd, self._dir_dirty
                unlink, self._unlink = self._unlink, []
                self._sealed, self._dir_dirty = [], False
            written = writes[-1][3] if writes else self.written
            try:
                # one writev per round, not per record: each return from a syscall must win the
                # GIL back from the loop, which may hold it for a whole switch interval (5 ms)
                for wfd, bufs in _by_fd(writes):
                    _write_all(wfd, bufs)
                del writes  # let go of the payloads (received frames) at once
                if not self.sync:
                    self._publish(written, written)
                for old in sealed:
                    if self.sync:
                        _fsync(old)
                    os.close(old)
                durable = self.durable
                if self.sync and target > durable:
                    _fsync(fd)  # everything written so far, which covers target
                    durable = written
                if self.sync and dir_dirty:
                    fsync_path(self.dir)
                for path in unlink:  # in gc() order: the invariants of a synchronous gc() hold
                    self.pool.retire(path)
            except Exception as e:  # noqa: BLE001 -- any failure here must stop the loop, not hang it
                with self._cond:
                    self.error = e if isinstance(e, OSError) else OSError(f"buffer log I/O thread: {e!r}")
                    self._cond.notify_all()
                self._wake()
                return
            if self.sync:
                self._publish(written, durable)

    def _publish(self, written: int, durable: int) -> None:
        with self._cond:
            self.written, self.durable = written, max(self.durable, durable)
            self._cond.notify_all()
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
        self.loc: dict = {}  # resident key -> (segment number, payload length)
        self.live_bytes = 0
        self.active: Segment | None = None
        self._fd = -1
        self.written = 0  # LSN: bytes appended since open()
        self.pool = _FreePool(directory)
        # always: every record is synced inline, so a roll must sync the new file inline too
        self._flusher = None if fsync == "always" else _Flusher(directory, self.pool, sync=fsync == "batch")
        self.compactions = 0
        self.recycled = 0  # rolls that reused a free file
        os.makedirs(directory, exist_ok=True)

    @property
    def durable(self) -> int:
        """The LSN up to which records are durable per the fsync policy (``never``: written)."""
        return self._flusher.durable if self._flusher is not None else self.written

    @property
    def wake_fd(self) -> int | None:
        """Readable after each round of the I/O thread: poll it to release what waited."""
        return self._flusher.wake_fd if self._flusher is not None else None

    def drain_wake(self) -> None:
        if self._flusher is not None:
            self._flusher.drain_wake()

    def seg_path(self, num: int) -> str:
        return os.path.join(self.dir, seg_name(num))

    # ---- replay ------------------------------------------------------------------------------

    def _paths(self) -> list[tuple[int, str]]:
        out = []
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if name.endswith(".tmp"):  # an interrupted compaction: the originals are intact
                os.unlink(path)
            elif name.startswith("free-") and name.endswith(".log"):
                self.pool.adopt(path)
            elif name.startswith("seg-") and name.endswith(".log"):
                out.append((int(name[4:-4]), path))
        return sorted(out)

    def replay(self) -> Replay:
        """Read every segment; rebuild which groups are resident and where their records are."""
        groups: dict = {}
        seen, done_keys, torn = [], [], 0
        for num, path in self._paths():
            with open(path, "rb") as f:
                data = f.read()
            records, end, verdict = scan(data, num)
            if verdict == "corrupt":
                raise CorruptLog(path, end)
            seg = self.segments[num] = Segment(num, path)
            for _after, kind, payload in records:
                if kind == GROUP:
                    key = group_key(payload)
                    if key is None:
                        continue
                    groups.pop(key, None)  # a compaction copy supersedes the original
                    groups[key] = bytes(payload)
                    self._place(key, seg, len(payload))
                elif kind == DONE:
                    _reason, keys = msgspec.msgpack.decode(payload)
                    keys = [(a, s) for a, s in keys]
                    for key in keys:
                        groups.pop(key, None)
                    self._cancel(keys, seg)
                    done_keys.extend(keys)
                else:
                    seen.append(msgspec.msgpack.decode(payload))
            seg.size, seg.alloc = end, len(data)
            if verdict == "torn":  # cut off: nothing of this life may follow garbage, should the file be read again
                torn += 1
                log.warning("segment %s: cutting off the torn record at offset %d (never acknowledged)", path, end)
                os.truncate(path, end)
                seg.alloc = end
        return Replay(groups, seen, done_keys, torn)

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
        """Append the encoded group ``raw`` (bytes or a received frame, written as is)."""
        self.make_room(len(raw))
        self._write(GROUP, raw)
        self._place(key, self.active, len(raw))

    def append_done(self, keys: list, reason: str) -> None:
        if not keys:
            return
        self._write(DONE, msgspec.msgpack.encode([reason, keys]))
        self._cancel(keys, self.active)

    def commit(self, wait: bool = True) -> None:
        """Make everything written so far durable; ``wait=False`` (the server loop, ``batch``)
        only hands it to the flusher and returns: watch ``durable`` / ``wake_fd``."""
        if self._flusher is None:  # always: written and synced record by record
            return
        self._flusher.check()
        if self.fsync == "batch":
            self._flusher.request(self.written)
        if wait and self._flusher.running:
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
        """Bytes of records in the segments (what the compaction trigger weighs)."""
        return sum(s.size for s in self.segments.values())

    @property
    def file_bytes(self) -> int:
        """What the log occupies on disk: the segment files, recycled ones whole, and the pool."""
        return sum(max(s.size, s.alloc) for s in self.segments.values()) + self.pool.nbytes()

    def _write(self, kind: int, payload) -> None:
        header = encode_record(kind, payload, self.active.num)
        size = HEADER.size + len(payload)
        self.active.size += size
        self.written += size
        if self._flusher is not None and self._flusher.running:
            self._flusher.write(self._fd, header, payload, self.written)
            return
        _write_all(self._fd, [header, payload])
        if self.fsync == "always":
            _fsync(self._fd)

    def _place(self, key, seg: Segment, n: int) -> None:
        old = self.loc.get(key)
        if old is not None:  # replay of a compaction copy
            self.segments[old[0]].live -= 1
            self.live_bytes -= HEADER.size + old[1]
        self.loc[key] = (seg.num, n)
        seg.live += 1
        self.live_bytes += HEADER.size + n

    def _cancel(self, keys, seg: Segment) -> None:
        for key in keys:
            where = self.loc.pop(key, None)
            if where is None:
                continue
            origin = where[0]
            self.live_bytes -= HEADER.size + where[1]
            self.segments[origin].live -= 1
            if origin != seg.num:
                seg.refs.add(origin)

    def _roll(self) -> None:
        num = max(self.segments, default=0) + 1
        seg = Segment(num, self.seg_path(num))
        free = self.pool.take()
        if free is not None:  # overwritten from offset 0; replay stops where this life's records end
            os.rename(free, seg.path)
            fd = os.open(seg.path, os.O_WRONLY)
            seg.alloc = os.fstat(fd).st_size
            self.recycled += 1
        else:
            fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        background = self._flusher is not None and self._flusher.running
        if background:
            self._flusher.switch(fd)  # it syncs (batch) and closes the old segment
        else:
            self._close_fd()
        self.active = self.segments[num] = seg
        self._fd = fd
        self._write(SEEN if free is not None else SEEN_NEW, msgspec.msgpack.encode(self._snapshot()))
        seg.snap_lsn = self.written
        # the snapshot is what lets older segments go: gc() deletes none before it is durable
        if not background:
            self._sync_new_file()
        elif self.fsync == "batch":
            self._flusher.request(self.written)

    def _sync_new_file(self) -> None:
        if self.fsync == "never":
            return
        _fsync(self._fd)
        fsync_path(self.dir)

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
                self.pool.retire(seg.path)
            del self.segments[num]
            removed += 1
        return removed

    def compaction_due(self) -> bool:
        """Old segments pinned by long-lived groups take more than twice the live bytes plus two
        segments (and there are more than two). Each rewrite copies at most the live bytes and
        happens only after the disk has grown by more than that: write amplification below 2x."""
        self.gc()
        return len(self.segments) > 2 and self.disk_bytes > 2 * self.live_bytes + 2 * self.segment_bytes

    def maybe_compact(self, resident: Callable[[], Iterable[tuple]]) -> bool:
        """Rewrite the resident groups into one fresh segment when :meth:`compaction_due`."""
        if not self.compaction_due():
            return False
        self.compact(resident)
        return True

    def compact(self, resident: Callable[[], Iterable[tuple]]) -> None:
        """``resident()`` yields ``(key, encoded group)`` for every resident group."""
        background = self._flusher is not None and self._flusher.running
        if background:  # rare: do it synchronously, with every earlier record already on disk
            self._fd = self._flusher.stop(self.written)
        num = max(self.segments) + 1
        path = self.seg_path(num)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        new = Segment(num, path)
        placed = []
        records = [(SEEN_NEW, None, msgspec.msgpack.encode(self._snapshot()))]
        records += [(GROUP, key, raw) for key, raw in resident()]
        try:
            for kind, key, payload in records:
                _write_all(fd, [encode_record(kind, payload, num), payload])
                if kind == GROUP:
                    placed.append((key, len(payload)))
                new.size += HEADER.size + len(payload)
            if self.fsync != "never":
                _fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._close_fd()
        old = list(self.segments.values())
        self.segments = {num: new}
        self.loc.clear()
        self.live_bytes = 0
        for key, n in placed:
            self._place(key, new, n)
        self.active = new
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._sync_new_file()  # the rename is durable before the originals go
        for seg in old:
            self.pool.retire(seg.path)
        if background:
            self._flusher.start(self._fd, self.written)
        self.compactions += 1
        log.info("compacted %d segments into %s (%d resident groups)", len(old), path, len(placed))


def seg_name(num: int) -> str:
    return f"seg-{num:08d}.log"


# ---- salvage ---------------------------------------------------------------------------------

_KIND_NAMES = {GROUP: "GROUP", DONE: "DONE", SEEN: "SEEN", SEEN_NEW: "SEEN"}


def _describe(data, pos: int, stop: int, seg: int) -> str:
    """What the damaged bytes ``[pos, stop)`` held, as far as their header still says."""
    if stop - pos >= HEADER.size:
        _hcrc, _pcrc, n, kind, s = HEADER.unpack_from(data, pos)
        if kind in KINDS and s == seg and pos + HEADER.size + n <= stop:
            payload = bytes(data[pos + HEADER.size:pos + HEADER.size + n])
            what = _KIND_NAMES[kind]
            key = group_key(payload) if kind == GROUP else None
            if kind == GROUP:
                return f"a GROUP record, an acknowledged group lost{f' (probably {key})' if key else ''}"
            if kind == DONE:
                return "a DONE record: the groups it retired are resident again and will be served again"
            return f"a {what} record: keys accepted before this segment may be accepted again if resent"
    return "unreadable bytes: whatever records they held (groups, retirements) are lost"


def _salvage_segment(path: str, num: int) -> list[str] | None:
    """Rewrite one damaged segment with every intact record of its life; None if undamaged."""
    with open(path, "rb") as f:
        data = f.read()
    records, pos, verdict = scan(data, num)
    if verdict != "corrupt":
        return None
    kept, report, fresh = [records], [], bool(records) and records[0][1] == SEEN_NEW
    while _verdict(data, pos, num, fresh) == "corrupt":  # else the end, or a torn tail
        nxt = _resync(data, pos + 1, num)
        stop = len(data) if nxt is None else nxt
        report.append(f"  bytes {pos}..{stop}: {_describe(data, pos, stop, num)}")
        if nxt is None:
            break
        more, pos = _records(data, nxt, num)
        kept.append(more)
    out = b"".join(bytes(data[after - HEADER.size - len(p):after]) for run in kept for after, _k, p in run)
    n_kept = sum(map(len, kept))
    aside = os.path.join(os.path.dirname(path), "damaged", f"{os.path.basename(path)}.{uuid.uuid4().hex[:8]}")
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.link(path, aside)  # the original stays, whole, until the repaired file has replaced it
    fsync_path(os.path.dirname(aside))
    atomic_write(path, out)
    return [f"{path}: kept {n_kept} intact records, original moved to {aside}; lost:", *report]


def salvage(directory: str) -> list[str]:
    """Repair every damaged segment of the log in ``directory`` (the buffer must be stopped):
    each keeps every intact record of its life, before and after the damage; the original goes
    to ``directory/damaged/``. Returns the report, one line per file and per damaged range."""
    lines = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("seg-") and name.endswith(".log"):
            lines += _salvage_segment(os.path.join(directory, name), int(name[4:-4])) or []
    return lines or [f"{directory}: no damaged segment"]


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="driftrl buffer segment log tools")
    ap.add_argument("--salvage", metavar="DIR", required=True,
                    help="repair the damaged segments of RUN_DIR/buffer (with the buffer stopped)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.salvage):
        ap.error(f"{args.salvage} is not a directory (want RUN_DIR/buffer)")
    for line in salvage(args.salvage):
        print(line)


if __name__ == "__main__":
    main()
