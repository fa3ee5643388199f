"""Group commit in the segment log (``buffer.fsync = batch``), without sockets: deletions wait for
the snapshot that supersedes them, a failed background fsync surfaces on every later turn, and a
compaction stops and restarts the I/O thread without losing an acked record."""

import os

import pytest

from buffer import persist
from buffer.persist import SegmentLog
from buffer.store import SeenKeys
from core.messages import encode
from tests.support.buffer import gate, reopen_log  # noqa: F401 -- gate is a fixture
from tests.support.synth import make_group


def small(actor, seq):
    return make_group(actor, seq, completions=2, tokens=16)


def open_log(d, segment_bytes, seen):
    return reopen_log(d, segment_bytes, seen)[0]


def test_gc_deletes_no_segment_before_the_snapshot_that_supersedes_it_is_durable(tmp_path, gate):
    seen = SeenKeys()
    lg = open_log(tmp_path, 4096, seen)
    gate.close()
    for i in range(30):  # several rolls; everything consumed at once
        seen.add(("a", i))
        lg.append_group(("a", i), encode(small("a", i)))
        lg.append_done([("a", i)], "consumed")
    assert gate.blocked.wait(5)
    n_segments = len(lg.segments)
    assert n_segments > 2 and lg.gc() == 0  # only snapshots nobody has synced yet remember them
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".log")]) == n_segments
    gate.open()
    lg.commit()
    assert lg.gc() == n_segments - 1
    lg.close()
    names = os.listdir(tmp_path)
    assert [n for n in names if n.startswith("seg-")] == [os.path.basename(lg.active.path)]
    # the deleted segments' files wait for reuse, a bounded pool of them
    assert 0 < len([n for n in names if n.startswith("free-")]) <= persist.FREE_FILES
    replayed = SeenKeys()
    lg2 = open_log(tmp_path, 4096, replayed)
    assert all(("a", i) in replayed for i in range(30))  # the dedup memory survived the deletions
    lg2.close()


def test_a_failed_background_fsync_is_raised_in_the_loop(tmp_path, monkeypatch):
    lg = SegmentLog(str(tmp_path), 1 << 20, fsync="batch")
    lg.open(dict)

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(persist, "_fsync", broken)
    lg.append_group(("a", 0), encode(small("a", 0)))
    with pytest.raises(OSError, match="Input/output"):
        lg.commit()
    with pytest.raises(OSError):  # and on every later turn: acks never leave after a lost write
        lg.commit(wait=False)
    assert lg.durable < lg.written
    lg.close()


def test_group_commit_survives_compaction_and_close(tmp_path):
    """Compaction stops the flusher, rewrites, restarts it; nothing acked is lost on replay."""
    seen = SeenKeys()
    lg = open_log(tmp_path, 4096, seen)
    raws = {}
    for i in range(60):
        key = ("a", i)
        raws[key] = encode(small("a", i))
        seen.add(key)
        lg.append_group(key, raws[key])
        if i % 10:  # every tenth stays resident and pins its segment
            lg.append_done([key], "consumed")
            del raws[key]
        lg.commit(wait=False)
        lg.maybe_compact(lambda: iter(raws.items()))
    lg.commit()
    assert lg.compactions > 0 and lg.durable == lg.written
    lg.close()
    lg2 = SegmentLog(str(tmp_path), 4096, fsync="batch")
    assert lg2.replay().groups == raws
