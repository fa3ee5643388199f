"""The one durable copy of every accepted group: SQLite in WAL mode, ``run_dir/buffer/groups.sqlite``.

Why SQLite: atomic commits, recovery from a write cut short (its WAL) and an integrity check, from
the most trusted embedded database, where a hand-built log needs recycling, salvage and compaction.
A group is written when accepted and kept after training until a learner checkpoint that a fallback
could still load covers its step: a restarted learner is served again what it trained since its
checkpoint, so the learner keeps no journal. The server commits once per loop turn that accepted
a group (group commit) and only then sends the acks and batches that depend on it; a learner's
marks alone wait for the next such commit, or ``LAZY_COMMIT_S``. SQLite checks its own pages; each
group also carries its crc32c (SQLite does not checksum data). Either failing refuses the store by
name, never loads it: ``python -m buffer.durable --drop-damaged RUN_DIR/buffer`` forgets the
damaged groups (the rest is kept) and names them.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import time
from typing import Iterable

import crc32c

RESIDENT, TRAINED, DONE = 0, 1, 2
# a learner's marks alone (trained, covered, dropped) wait up to this long for a commit: losing one
# costs a group served again, which the learner's audit trail reports consumed without training it
LAZY_COMMIT_S = 1.0
FILE = "groups.sqlite"
_SCHEMA = """CREATE TABLE IF NOT EXISTS groups (
    actor TEXT NOT NULL, seq INTEGER NOT NULL,
    state INTEGER NOT NULL,  -- RESIDENT, TRAINED or DONE
    step INTEGER,            -- TRAINED: the learner step that trained it
    raw BLOB,                -- the encoded RolloutGroup as its actor sent it; NULL once DONE
    crc INTEGER,             -- crc32c of raw
    PRIMARY KEY (actor, seq));
CREATE INDEX IF NOT EXISTS trained_by_step ON groups (step) WHERE state = 1;  -- covered(), requeue()
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);  -- 'learner_version'"""


class CorruptStore(RuntimeError):
    """The store fails SQLite's integrity check or a group's crc32c: it was not loaded."""


class StoreWriteFailed(RuntimeError):
    """The disk is full or failed: nothing uncommitted was acknowledged; the run resumes once fixed."""


class DurableStore:
    """``directory`` None (``buffer.persist = false``): in memory -- a restarted learner is still
    served again what it trained since its checkpoint; a restarted buffer starts empty."""

    def __init__(self, directory: str | None, fsync: str = "batch"):
        self.path = ":memory:"
        if directory is not None:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.path = os.path.join(directory, FILE)
        self.always, self._added = fsync == "always", False  # _added: an add (its ack) awaits the commit
        self._adds: list[tuple] = []  # rows of add(), inserted together before any other statement
        self._marked_at: float | None = None  # first mark not committed yet
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)  # one user at a time
            # (a new store) 16 KiB pages: a turn of small groups rewrites fewer bytes than with 64 KiB
            # and a long group spans few pages (bench/buffer.py: the least CPU per turn for both)
            self.db.execute("PRAGMA page_size=16384")
            self.db.execute("PRAGMA cache_size=-32768")  # KiB: the pages a turn touches stay cached
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(f"PRAGMA synchronous={'OFF' if fsync == 'never' else 'FULL'}")
            verdict = self.db.execute("PRAGMA quick_check").fetchone()[0]
            self.db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            verdict = str(e)
        if verdict != "ok":
            raise CorruptStore(f"the buffer's store {self.path} is damaged ({verdict}); it was not loaded. "
                               "Restore it from a backup, or move it aside to start the buffer empty "
                               "(the groups it held are lost; the actors' spools resend what was never acked)")
        self.db.execute("BEGIN")

    def load(self) -> tuple[list[bytes], list[tuple[str, int]]]:
        """The resident groups in arrival order and every key ever accepted (sorted); held groups checked first."""
        bad = self.damaged()
        if bad:
            raise CorruptStore(f"the buffer's store {self.path} is damaged: {len(bad)} groups fail their crc32c "
                               f"(first {bad[0]}); it was not loaded. `python -m buffer.durable --drop-damaged "
                               f"{os.path.dirname(self.path)}` forgets them and keeps the rest")
        raws = [r for (r,) in self.db.execute(f"SELECT raw FROM groups WHERE state={RESIDENT} ORDER BY rowid")]
        keys = self.db.execute("SELECT actor, seq FROM groups ORDER BY actor, seq").fetchall()
        return raws, keys

    def record(self) -> int:
        """The newest learner version the buffer has evidence of (-1: none): see ``set_record``."""
        row = self.db.execute("SELECT value FROM meta WHERE name='learner_version'").fetchone()
        return row[0] if row else -1

    def set_record(self, version: int) -> None:
        """A version a learner showed (its first Hello, its trained steps); committed with the marks."""
        self._run("INSERT OR REPLACE INTO meta VALUES ('learner_version', ?)", [(version,)])

    def add(self, key: tuple[str, int], raw) -> None:
        raw = memoryview(raw)
        self._adds.append((*key, RESIDENT, raw, crc32c.crc32c(raw)))
        self._added = True
        if self.always:
            self.commit(force=True)

    def trained(self, keys: Iterable, step: int) -> None:
        """Trained at ``step`` (kept until covered); ``step`` < 0: never trained, forgotten now."""
        if step < 0:
            self.done(keys)
        else:
            self._run(f"UPDATE groups SET state={TRAINED}, step=? WHERE actor=? AND seq=?",
                      [(step, *k) for k in keys])

    def done(self, keys: Iterable) -> None:
        self._run(f"UPDATE groups SET state={DONE}, raw=NULL WHERE actor=? AND seq=?", [tuple(k) for k in keys])

    def covered(self, step: int) -> None:
        """A checkpoint holds every step up to ``step``: those groups' bytes are no longer needed."""
        self._run(f"UPDATE groups SET state={DONE}, raw=NULL WHERE state={TRAINED} AND step<=?", [(step,)])

    def requeue(self, step: int) -> list[bytes]:
        """The groups trained after ``step`` (a learner restarted from it), resident again."""
        self._insert_adds()
        raws = [r for (r,) in self.db.execute(f"SELECT raw FROM groups WHERE state={TRAINED} AND step>? "
                                              "ORDER BY step, rowid", (step,))]
        self._run(f"UPDATE groups SET state={RESIDENT} WHERE state={TRAINED} AND step>?", [(step,)])
        return raws

    def damaged(self) -> list[tuple[str, int]]:
        self._insert_adds()
        rows = self.db.execute(f"SELECT actor, seq, raw, crc FROM groups WHERE state!={DONE}")
        return [(a, q) for a, q, raw, crc in rows if crc32c.crc32c(raw) != crc]

    def commit(self, force: bool = False) -> None:
        """Commit when an acknowledgement depends on it (an add), else when the marks have waited
        LAZY_COMMIT_S (one commit, one fsync, per learner step instead of two)."""
        marked = self._marked_at is not None and (force or time.monotonic() - self._marked_at >= LAZY_COMMIT_S)
        if self._added or marked:
            self._insert_adds()
            self._write(self.db.execute, "COMMIT")
            self.db.execute("BEGIN")
            self._added, self._marked_at = False, None

    def disk_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))

    def close(self) -> None:
        self.commit(force=True)
        self.db.execute("COMMIT")
        self.db.close()

    def _insert_adds(self) -> None:
        rows, self._adds = self._adds, []
        if rows:
            self._write(self.db.executemany, "INSERT INTO groups VALUES (?, ?, ?, NULL, ?, ?)", rows)

    def _run(self, sql: str, rows: list) -> None:
        if rows:
            self._insert_adds()
            self._write(self.db.executemany, sql, rows)
            self._marked_at = self._marked_at or time.monotonic()
            if self.always:
                self.commit(force=True)

    def _write(self, call, *args) -> None:
        try:
            call(*args)
        except sqlite3.OperationalError as e:
            if not e.sqlite_errorname.startswith(("SQLITE_FULL", "SQLITE_IOERR")):
                raise
            raise StoreWriteFailed(f"the buffer's store {self.path} could not be written ({e})") from e


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="forget the damaged groups of a buffer's store, keep the rest")
    ap.add_argument("--drop-damaged", required=True, metavar="RUN_DIR/buffer")
    store = DurableStore(ap.parse_args(argv).drop_damaged)
    bad = store.damaged()
    store.done(bad)
    store.close()
    print(f"{len(bad)} damaged groups forgotten: {bad}" if bad else "no damaged group")


if __name__ == "__main__":
    main()
