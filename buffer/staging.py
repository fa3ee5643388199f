"""Staging slots: an actor's groups that wait for their ack, in a file the buffer can read.

One file per actor, ``run_dir/buffer/staging/<digest of actor id>.slots``:

* page 0: ``magic "DRSTAGE1", slot_bytes u64, nslots u32, reserved_seq i64, id_len u16, actor id``;
* slot ``i`` at ``PAGE + i * slot_bytes``: ``<magic u32, crc32c u32, seq i64, length u32>`` then,
  at ``+ SLOT_HEAD``, the encoded ``RolloutGroup``.

The actor (:class:`Staging`) writes a group into a free slot and sends only a ``GroupRef`` on
the socket; the buffer (:class:`StagingReader`) checks the slot against the ref, validates the
bytes like any frame and copies them into its own segment log before it acks; on the ack the
actor frees the slot (magic zeroed) for the next group. So a group crosses no socket, and the
slots double as the actor's spool: they live in the page cache, survive the actor process, and
its next incarnation resends a ref for every slot still holding a group (:meth:`Staging.pending`).

``slot_bytes`` fits the largest frame the buffer accepts, so the file is sparse: only the pages
groups touch take memory or disk. Slots are reused, so their pages stay cached and a write
costs a memcpy, not a page allocation (about 5x cheaper for 100 KB groups here).

Only processes that can open ``run_dir`` -- the same user on the buffer's host -- can stage
groups; remote actors send the group bytes inline instead (the same slots then only serve as
their spool). The file never shrinks while in use: the buffer maps it, and a mapped file that
shrank would fault on read.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct

import crc32c

PAGE = 4096
FILE_MAGIC = b"DRSTAGE1"
FILE_HEAD = struct.Struct("<8sQIqH")  # magic, slot_bytes, nslots, reserved_seq, id_len
RESERVED_AT = 8 + 8 + 4  # offset of reserved_seq in the file header
SLOT_MAGIC = 0x544C5347  # "GSLT"
SLOT_HEAD_FMT = struct.Struct("<IIqI")  # magic, crc32c(payload), seq, length
SLOT_HEAD = 64  # payload offset within a slot: a cache line after the header
MAX_ID_BYTES = 512


def staging_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "buffer", "staging")


def staging_path(run_dir: str, actor_id: str) -> str:
    # a digest, not the id: an actor id is arbitrary text and must never become a path
    digest = hashlib.blake2b(actor_id.encode(), digest_size=16).hexdigest()
    return os.path.join(staging_dir(run_dir), f"{digest}.slots")


def slot_bytes_for(max_payload: int) -> int:
    return -(-(SLOT_HEAD + max_payload) // PAGE) * PAGE


def crc(data) -> int:
    return crc32c.crc32c(data)


class Staging:
    """The actor's side: owns the file, fills and frees slots."""

    def __init__(self, path: str, actor_id: str, nslots: int, max_payload: int):
        self.path, self.actor_id = path, actor_id
        os.makedirs(os.path.dirname(path), exist_ok=True)
        ident = actor_id.encode()
        if len(ident) > MAX_ID_BYTES:
            raise ValueError(f"actor id longer than {MAX_ID_BYTES} bytes")
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            head = os.pread(self._fd, PAGE, 0)
            if len(head) >= FILE_HEAD.size and head[:8] == FILE_MAGIC:
                _, self.slot_bytes, have, self.reserved, n = FILE_HEAD.unpack_from(head)
                owner = head[FILE_HEAD.size:FILE_HEAD.size + n].decode(errors="replace")
                if owner != actor_id:
                    raise ValueError(f"staging file {path} belongs to actor {owner!r}, not {actor_id!r}")
                if self.slot_bytes < slot_bytes_for(max_payload):
                    raise ValueError(f"staging file {path} has {self.slot_bytes}-byte slots; this actor "
                                     f"needs {slot_bytes_for(max_payload)} (buffer.max_frame_bytes grew)")
                self.nslots = max(have, nslots)  # never shrink: the buffer may map the old size
                self.reserved = self.reserved if self.reserved >= 0 else None
            else:
                self.slot_bytes, self.nslots, self.reserved = slot_bytes_for(max_payload), nslots, None
            size = PAGE + self.nslots * self.slot_bytes
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)  # sparse: only touched pages are allocated
            os.pwrite(self._fd, FILE_HEAD.pack(FILE_MAGIC, self.slot_bytes, self.nslots,
                                               -1 if self.reserved is None else self.reserved,
                                               len(ident)) + ident, 0)
            self._mm = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self._free = list(range(self.nslots - 1, -1, -1))  # pop() hands out slot 0 first
        self.max_payload = self.slot_bytes - SLOT_HEAD

    def pending(self) -> list[tuple[int, int, bytes]]:
        """``(seq, slot, payload)`` of every slot an earlier incarnation left unacked, by seq."""
        out = []
        for slot in range(self.nslots):
            off = self._off(slot)
            magic, c, seq, n = SLOT_HEAD_FMT.unpack_from(self._mm, off)
            if magic != SLOT_MAGIC:
                continue
            payload = bytes(self._mm[off + SLOT_HEAD:off + SLOT_HEAD + n]) if n <= self.max_payload else b""
            if n > self.max_payload or crc(payload) != c:  # torn by a crash mid-write: never sent
                self._clear(slot)
                continue
            out.append((seq, slot, payload))
        taken = {slot for _, slot, _ in out}
        self._free = [s for s in self._free if s not in taken]
        return sorted(out)

    def put(self, seq: int, payload: bytes) -> tuple[int, int]:
        """Stage ``payload``; returns ``(slot, crc)``. The caller keeps at most ``nslots`` pending."""
        if len(payload) > self.max_payload:
            raise ValueError(f"group of {len(payload)} bytes exceeds the staging slot ({self.max_payload})")
        slot = self._free.pop()
        off = self._off(slot)
        c = crc(payload)
        self._mm[off + SLOT_HEAD:off + SLOT_HEAD + len(payload)] = payload
        # the header last: a crash between the two leaves a slot that fails its crc, not a wrong one
        SLOT_HEAD_FMT.pack_into(self._mm, off, SLOT_MAGIC, c, seq, len(payload))
        return slot, c

    def release(self, slot: int) -> None:
        self._clear(slot)
        self._free.append(slot)

    def reserve(self, reserved: int) -> None:
        """Persist the highest seq handed out (page cache: survives the process, like the slots)."""
        self.reserved = reserved
        struct.pack_into("<q", self._mm, RESERVED_AT, reserved)

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()
            os.close(self._fd)

    def _clear(self, slot: int) -> None:
        struct.pack_into("<I", self._mm, self._off(slot), 0)

    def _off(self, slot: int) -> int:
        return PAGE + slot * self.slot_bytes


class StagingError(ValueError):
    """A ref that does not match its slot; ``reason`` is the ``buffer/dropped_invalid`` key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class StagingReader:
    """The buffer's side: maps each actor's staging file (read-only) and checks refs against it."""

    MAX_OPEN = 256

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._maps: dict[str, tuple[mmap.mmap, int, int]] = {}  # actor id -> (map, slot_bytes, nslots)

    def read(self, actor_id: str, seq: int, slot: int, length: int, c: int) -> memoryview:
        """The staged payload of ``(actor_id, seq)``, checked against the ref; a view into the map.

        Valid until the actor frees the slot, which it does only after this group's ack.
        """
        try:
            return self._read(self._map(actor_id, False), seq, slot, length, c)
        except StagingError:
            # the actor may have recreated its file (a new inode): look once more before refusing
            return self._read(self._map(actor_id, True), seq, slot, length, c)

    def _read(self, m, seq: int, slot: int, length: int, c: int) -> memoryview:
        mm, slot_bytes, nslots = m
        if not 0 <= slot < nslots or not 0 <= length <= slot_bytes - SLOT_HEAD:
            raise StagingError("ref_bounds", f"slot {slot} length {length}")
        off = PAGE + slot * slot_bytes
        magic, hc, hseq, hn = SLOT_HEAD_FMT.unpack_from(mm, off)
        if magic != SLOT_MAGIC or hseq != seq or hn != length or hc != c:
            raise StagingError("ref_mismatch", f"slot {slot} holds seq {hseq}, not {seq}")
        # The payload's crc is the actor's word, not re-computed here: the bytes are decoded and
        # validated next, and the crc only guards the segment log against torn writes, where
        # replay checks it. A slot is written before its ref is sent and rewritten only after
        # its ack, so what was validated is what gets logged -- unless the actor breaks that
        # rule, which a process that can write run_dir could do to the log itself anyway.
        return memoryview(mm)[off + SLOT_HEAD:off + SLOT_HEAD + length]

    def _map(self, actor_id: str, fresh: bool):
        m = self._maps.get(actor_id)
        if m is not None and not fresh:
            return m
        self._drop(actor_id)
        path = staging_path(self.run_dir, actor_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise StagingError("ref_unreadable", f"{type(e).__name__} for actor {actor_id[:64]!r}") from None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, FILE_HEAD.size, 0)
            if len(head) < FILE_HEAD.size or head[:8] != FILE_MAGIC:
                raise StagingError("ref_unreadable", "not a staging file")
            _, slot_bytes, nslots, _, _ = FILE_HEAD.unpack(head)
            if slot_bytes < PAGE or size < PAGE + nslots * slot_bytes:
                raise StagingError("ref_unreadable", "staging file shorter than its header says")
            mm = mmap.mmap(fd, PAGE + nslots * slot_bytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if len(self._maps) >= self.MAX_OPEN:
            self._drop(next(iter(self._maps)))
        m = self._maps[actor_id] = (mm, slot_bytes, nslots)
        return m

    def _drop(self, actor_id: str) -> None:
        m = self._maps.pop(actor_id, None)
        if m is not None:
            # a view still alive (a queued log write holds one until written) keeps the mapping
            # until that view dies; the GC unmaps it then
            with contextlib.suppress(BufferError):
                m[0].close()

    def close(self) -> None:
        for a in list(self._maps):
            self._drop(a)


def staged_seqs(path: str) -> list[int]:
    """Seqs whose groups are staged (intact) in a staging file: a read-only look, for tools."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return []
    try:  # slot by slot: the file is sparse and mostly holes, never read it whole
        head = os.pread(fd, FILE_HEAD.size, 0)
        if len(head) < FILE_HEAD.size or head[:8] != FILE_MAGIC:
            return []
        _, slot_bytes, nslots, _, _ = FILE_HEAD.unpack(head)
        out = []
        for slot in range(nslots):
            off = PAGE + slot * slot_bytes
            h = os.pread(fd, SLOT_HEAD_FMT.size, off)
            if len(h) < SLOT_HEAD_FMT.size:
                break
            magic, c, seq, n = SLOT_HEAD_FMT.unpack(h)
            if magic == SLOT_MAGIC and n <= slot_bytes - SLOT_HEAD and \
                    crc(os.pread(fd, n, off + SLOT_HEAD)) == c:
                out.append(seq)
        return sorted(out)
    finally:
        os.close(fd)
