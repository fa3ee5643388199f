"""Segment log: replay rebuilds exactly the resident set and the dedup memory; torn tails are
ignored and counted; disk use stays bounded under a long stream."""

import os

import pytest

from buffer import persist
from buffer.persist import SegmentLog
from buffer.store import SeenKeys
from buffer.synth import make_group
from buffer.testing import reopen_log
from core.messages import encode


def raw(seq, actor="a", tokens=16):
    return encode(make_group(actor, seq, completions=2, tokens=tokens))


def open_log(d, segment_bytes=1 << 20, seen=None):
    return reopen_log(d, segment_bytes, seen, done_keys_seen=False)[:2]


def test_replay_rebuilds_resident_set_in_arrival_order(tmp_path):
    lg, _ = open_log(tmp_path)
    raws = [raw(i) for i in range(6)]
    for i in range(6):
        lg.append_group(("a", i), raws[i])
    lg.append_done([("a", 1), ("a", 4)], "consumed")
    lg.append_done([("a", 2)], "stale")
    lg.commit()
    lg.close()
    _, rep = open_log(tmp_path)
    assert list(rep.groups) == [("a", 0), ("a", 3), ("a", 5)]
    assert rep.groups[("a", 3)] == raws[3]  # byte-exact: the learner gets what the actor sent
    assert sorted(rep.done_keys) == [("a", 1), ("a", 2), ("a", 4)]
    assert rep.corrupt == 0


@pytest.mark.parametrize("cut", [1, 5, 9, 200])
def test_torn_tail_record_is_ignored_and_counted(tmp_path, cut):
    lg, _ = open_log(tmp_path)
    for i in range(3):
        lg.append_group(("a", i), raw(i))
    lg.close()
    path = lg.active.path
    size = os.path.getsize(path)
    os.truncate(path, size - cut)  # the last record lost its last `cut` bytes
    _, rep = open_log(tmp_path)
    assert list(rep.groups) == [("a", 0), ("a", 1)]
    assert rep.corrupt == 1
    # the torn bytes were cut off, so nothing is ever appended after garbage
    data = open(path, "rb").read()
    *_, (end, _kind, _payload) = persist.iter_records(data)
    assert end == len(data)


def test_flipped_byte_is_caught_by_crc(tmp_path):
    lg, _ = open_log(tmp_path)
    for i in range(3):
        lg.append_group(("a", i), raw(i))
    lg.close()
    data = bytearray(open(lg.active.path, "rb").read())
    data[-100] ^= 0xFF  # inside the last group's payload
    open(lg.active.path, "wb").write(bytes(data))
    _, rep = open_log(tmp_path)
    assert list(rep.groups) == [("a", 0), ("a", 1)] and rep.corrupt == 1


def test_dedup_memory_survives_deletion_of_every_segment_that_held_the_keys(tmp_path):
    seen = SeenKeys()
    lg, _ = open_log(tmp_path, segment_bytes=4096, seen=seen)
    for i in range(40):
        seen.add(("a", i))
        lg.append_group(("a", i), raw(i))
        lg.append_done([("a", i)], "consumed")
        lg.commit()  # gc() deletes a segment only once the snapshot that supersedes it is durable
        lg.gc()
    lg.close()
    assert len(lg.segments) <= 2  # consumed segments were deleted
    seen2 = SeenKeys()
    _, rep = open_log(tmp_path, seen=seen2)
    for k in rep.done_keys:
        seen2.add(k)
    assert rep.groups == {}
    assert all(("a", i) in seen2 for i in range(40)) and ("a", 40) not in seen2


def test_a_done_record_is_kept_while_the_group_it_cancels_is_on_disk(tmp_path):
    lg, _ = open_log(tmp_path, segment_bytes=2048)
    lg.append_group(("a", 0), raw(0))  # segment 1
    lg.append_group(("a", 1), raw(1))  # long-lived: pins segment 1
    for i in range(2, 8):  # rolls into later segments
        lg.append_group(("a", i), raw(i))
    lg.append_done([("a", 0)], "consumed")  # lands in the newest segment, cancels one in segment 1
    for i in range(2, 8):
        lg.append_done([("a", i)], "consumed")
    lg.gc()
    lg.close()
    _, rep = open_log(tmp_path)
    assert list(rep.groups) == [("a", 1)]  # ("a", 0) did not come back to life


def test_disk_stays_bounded_over_a_long_stream_with_pinned_groups(tmp_path):
    seg = 16 << 10
    lg, _ = open_log(tmp_path, segment_bytes=seg)
    resident = {}
    peak_disk = peak_live = written = 0
    for i in range(3000):
        key = ("a", i)
        resident[key] = raw(i)
        lg.append_group(key, resident[key])
        written += len(resident[key])
        if i % 50 != 0:  # every 50th group stays resident for a long time
            lg.append_done([key], "consumed")
            del resident[key]
        if i % 500 == 499:  # ... until it is finally consumed
            old = [k for k in resident if k[1] < i - 400]
            lg.append_done(old, "consumed")
            for k in old:
                del resident[k]
        lg.commit()
        lg.maybe_compact(lambda: iter(resident.items()))
        peak_disk = max(peak_disk, lg.disk_bytes)
        peak_live = max(peak_live, sum(len(r) + persist.HEADER.size for r in resident.values()))
    assert lg.compactions > 0
    # the compaction trigger: more than 2x the live records plus two segments (+ one record)
    assert peak_disk <= 2 * peak_live + 3 * seg
    assert peak_disk < written / 10
    lg.close()
    _, rep = open_log(tmp_path, segment_bytes=seg)
    assert rep.groups == resident  # compaction lost nothing and resurrected nothing


def test_interrupted_compaction_leaves_originals_authoritative(tmp_path):
    lg, _ = open_log(tmp_path)
    for i in range(3):
        lg.append_group(("a", i), raw(i))
    lg.close()
    with open(os.path.join(tmp_path, "seg-00000099.log.tmp"), "wb") as f:
        f.write(b"half a compaction")
    _, rep = open_log(tmp_path)
    assert list(rep.groups) == [("a", 0), ("a", 1), ("a", 2)]
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))


def test_bad_fsync_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="always|batch|never"):
        SegmentLog(str(tmp_path), 1024, fsync="sometimes")
