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

Disk stays bounded: segments roll at ``segment_bytes``. A sealed segment is deleted once none of
its groups is resident *and* none of its DONE records still cancels a group in a segment that
exists (else deleting it would resurrect that group on replay). When long-lived groups pin many
old segments, :meth:`SegmentLog.maybe_compact` rewrites the resident set into one fresh segment
(temp file, fsync, rename) and deletes everything older.
"""

from __future__ import annotations

import logging
import os
import struct
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


@dataclass
class Replay:
    groups: dict  # key -> raw bytes, resident at the crash, in arrival order
    seen: list  # SEEN snapshots found, oldest first
    done_keys: list  # keys from DONE records (they were seen too)
    corrupt: int  # segments whose tail was torn/corrupt


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
        self._dirty = False
        self.compactions = 0
        os.makedirs(directory, exist_ok=True)

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
        self.gc()

    def append_group(self, key, raw) -> None:
        size = HEADER.size + len(raw)
        if self.active.size > 0 and self.active.size + size > self.segment_bytes:
            self._roll()
        self._write(GROUP, raw)
        self._place(key, self.active, size)

    def append_done(self, keys: list, reason: str) -> None:
        if not keys:
            return
        self._write(DONE, msgspec.msgpack.encode([reason, keys]))
        self._cancel(keys, self.active)

    def commit(self) -> None:
        """Make everything written so far durable (batch mode: once per server loop turn)."""
        if self._dirty and self.fsync == "batch":
            os.fsync(self._fd)
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            if self.fsync != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    @property
    def disk_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    def _write(self, kind: int, payload) -> None:
        _write_all(self._fd, encode_record(kind, payload), payload)
        self.active.size += HEADER.size + len(payload)
        if self.fsync == "always":
            os.fsync(self._fd)
        else:
            self._dirty = True

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
        if self._fd >= 0:
            self.close()
        num = max(self.segments, default=0) + 1
        self.active = self.segments[num] = Segment(num, self._seg_path(num))
        self._fd = os.open(self.active.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._write(SEEN, msgspec.msgpack.encode(self._snapshot()))
        # the snapshot is what lets older segments go: it must be on disk before they are
        self._sync_new_file()

    def _seg_path(self, num: int) -> str:
        return os.path.join(self.dir, f"seg-{num:08d}.log")

    def _sync_new_file(self) -> None:
        if self.fsync == "never":
            return
        os.fsync(self._fd)
        self._dirty = False
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # ---- bounding the disk -------------------------------------------------------------------

    def gc(self) -> int:
        """Delete sealed segments that hold nothing a replay would need; returns how many."""
        removed = 0
        for num in sorted(self.segments):
            seg = self.segments[num]
            if seg is self.active or seg.live > 0 or any(r in self.segments for r in seg.refs):
                continue
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
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.close()
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
