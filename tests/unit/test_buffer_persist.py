"""Segment log: replay rebuilds exactly the resident set and the dedup memory; torn tails are
cut off and counted, while damage anywhere else stops the replay with the file and offset, and
the salvage keeps every intact record; disk use stays bounded under a long stream; recycled
segment files never bring back a record of their earlier life."""

import os

import pytest

from buffer import persist
from buffer.persist import HEADER, SegmentLog, parse_header, scan
from buffer.store import SeenKeys
from core.messages import encode
from tests.support.buffer import reopen_log, wait_for
from tests.support.synth import make_group


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
    assert rep.torn == 0


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
    assert rep.torn == 1
    # the torn bytes were cut off, so nothing is ever appended after garbage
    data = open(path, "rb").read()
    *_, (end, _kind, _payload) = scan(data)[0]
    assert end == len(data)


def three_groups(d):
    """A log of one segment file holding SEEN + groups 0, 1, 2; returns the file, the records'
    end offsets and the groups' bytes."""
    lg, _ = open_log(d)
    raws = [raw(i) for i in range(3)]
    for i in range(3):
        lg.append_group(("a", i), raws[i])
    lg.close()
    data = open(lg.active.path, "rb").read()
    return lg.active.path, [after for after, _, _ in scan(data)[0]], raws


def flip(path, offset):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("where", ["middle_payload", "middle_header", "last_payload", "seen_record"])
def test_a_flipped_byte_in_a_complete_record_stops_the_replay_with_file_and_offset(tmp_path, where):
    """Not a torn tail: the replay refuses to go on (it would drop acknowledged groups, or revive
    consumed ones) and names the file, the offset and the salvage command."""
    path, ends, _ = three_groups(tmp_path)
    start = {"middle_payload": ends[1], "middle_header": ends[1], "last_payload": ends[2],
             "seen_record": 0}[where]
    flip(path, start + {"middle_header": 3, "seen_record": HEADER.size}.get(where, HEADER.size + 5))
    with pytest.raises(persist.CorruptLog) as e:
        open_log(tmp_path)
    assert e.value.path == path and e.value.offset == start
    assert f"{path} at byte {start}" in str(e.value) and f"--salvage {tmp_path}" in str(e.value)


def test_salvage_keeps_every_intact_record_and_reports_the_lost_one(tmp_path):
    path, ends, raws = three_groups(tmp_path)
    flip(path, ends[1] + HEADER.size + 20)  # inside group 1's payload
    damaged = open(path, "rb").read()
    report = persist.salvage(str(tmp_path))
    assert "kept 3 intact records" in report[0] and "('a', 1)" in "\n".join(report)
    moved = os.listdir(tmp_path / "damaged")
    assert len(moved) == 1 and open(tmp_path / "damaged" / moved[0], "rb").read() == damaged
    _, rep = open_log(tmp_path)  # replays now, without the damaged record
    assert rep.groups == {("a", 0): raws[0], ("a", 2): raws[2]}
    assert persist.salvage(str(tmp_path)) == [f"{tmp_path}: no damaged segment"]


def test_what_a_cut_write_leaves_is_torn_only_where_a_cut_write_can_leave_it(tmp_path):
    """scan's verdicts on hand-made files: a fresh file (SEEN_NEW) can only end in a short record;
    a recycled one (SEEN) may end in a record whose tail is an earlier life's bytes; a tail of
    zeros is never written data; and damage followed by intact records is corruption anywhere."""
    def rec(kind, payload, seg):
        return persist.encode_record(kind, payload, seg) + payload

    old = b"".join(rec(persist.GROUP, raw(i, tokens=64), 1) for i in range(4))  # an earlier life
    seen = b"\x80"  # msgpack {}
    g0, g1 = rec(persist.GROUP, raw(10), 2), rec(persist.GROUP, raw(11), 2)
    cut = g1[:len(g1) // 2]  # header intact, payload cut short
    recycled = rec(persist.SEEN, seen, 2) + g0
    fresh = rec(persist.SEEN_NEW, seen, 2) + g0
    over_old = recycled + cut + old[len(recycled) + len(cut):]
    assert scan(over_old, 2)[1:] == (len(recycled), "torn")  # a cut write over the old bytes
    assert scan(recycled + old[len(recycled):], 2)[2] is None  # this life ends, the old one shows
    assert scan(fresh + cut, 2)[1:] == (len(fresh), "torn")  # short: a cut write
    assert scan(fresh + cut[:9], 2)[2] == "torn"  # a header cut short
    assert scan(fresh + bytes(300), 2)[2] == "torn"  # zeros: allocated, never written
    bad = bytearray(g1)
    bad[-3] ^= 1
    assert scan(fresh + bytes(bad), 2)[2] == "corrupt"  # complete, in a file of its own life
    assert scan(recycled + bytes(bad) + g0, 2)[2] == "corrupt"  # intact records follow
    assert scan(fresh + b"\x01" * 40 + g0, 2)[2] == "corrupt"


def test_salvage_cli_repairs_the_log_in_place(tmp_path):
    import subprocess
    import sys

    from tests.support.buffer import ROOT

    path, ends, _ = three_groups(tmp_path)
    flip(path, ends[0] + 2)  # group 0's header
    out = subprocess.run([sys.executable, "-m", "buffer.persist", "--salvage", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and "lost" in out.stdout and f"bytes {ends[0]}..{ends[1]}" in out.stdout
    _, rep = open_log(tmp_path)
    assert list(rep.groups) == [("a", 1), ("a", 2)]


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


# ---- recycled segment files ----------------------------------------------------------------------


def settle(lg):
    """Let the I/O thread write, then gc and wait until the deleted segments are retired (the
    thread renames them into the free pool): the next roll then finds a free file."""
    lg.commit()
    before = set(lg.segments)
    lg.gc()
    gone = before - set(lg.segments)
    wait_for(lambda: not any(os.path.exists(lg.seg_path(n)) for n in gone), timeout=5, every=0.005)


def free_files(d):
    return sorted(n for n in os.listdir(d) if n.startswith("free-") and n.endswith(".log"))


def open_never(d, seen, segment_bytes=4096):
    return reopen_log(d, segment_bytes, seen, fsync="never")[0]


class Churn:
    """Appends groups the way the server does; each is consumed ``lag`` appends later unless kept.

    The groups all encode to the same size (no ragged completions, one group_id, seqs < 128), so
    every segment's life has the same record layout and a shorter life ends exactly where an
    earlier life's record starts: replay then meets an intact header of that earlier life. With
    ``lag=1`` a segment's last group has its DONE record in the next segment, so an earlier life
    read back as this one would bring that group back.
    """

    def __init__(self, seen):
        self.seen, self.seq, self.raw = seen, 0, {}

    def run(self, lg, n, keep=(), lag=0):
        kept, due = [], []
        for _ in range(n):
            key = ("a", self.seq)
            raw = encode(make_group("a", self.seq, completions=2, tokens=16, ragged=False, group_id="g"))
            lg.make_room(len(raw))  # before the key is seen: see SegmentLog.make_room
            self.seen.add(key)
            lg.append_group(key, raw)
            self.raw[key] = raw
            (kept if self.seq in keep else due).append(key)
            while len(due) > lag:
                lg.append_done([due.pop(0)], "consumed")
            self.seq += 1
            settle(lg)
        if due:
            lg.append_done(due, "consumed")
            settle(lg)
        return kept


def test_segments_recycle_and_replay_never_resurrects_an_earlier_life(tmp_path):
    seen = SeenKeys()
    lg = open_never(tmp_path, seen)
    churn = Churn(seen)
    try:
        # a few never consumed, in between; they pin their segments
        kept = churn.run(lg, 60, keep={0, 17, 33})
        # then DONE records that cancel groups in the previous segment: a segment goes only after
        # the one before it, so nothing here may be pinned by a kept group
        kept += churn.run(lg, 60, lag=1)
        # end just after a roll: the active segment, a recycled file, holds one group of this
        # life followed by the rest of an earlier, longer one
        active = lg.active.num
        while lg.active.num == active:
            churn.run(lg, 1)
        assert kept == [("a", 0), ("a", 17), ("a", 33)] and churn.seq < 128
        assert lg.recycled > 0
        assert len(free_files(tmp_path)) <= persist.FREE_FILES
    finally:
        lg.close()
    assert len(free_files(tmp_path)) <= persist.FREE_FILES

    # some segment file is a recycled one with intact records of an earlier life after this life's
    stale_tails = 0
    for name in sorted(n for n in os.listdir(tmp_path) if n.startswith("seg-")):
        num = int(name[4:-4])
        with open(tmp_path / name, "rb") as f:
            data = f.read()
        _, end, verdict = scan(data, num)
        assert verdict is None
        old = [h for h in (parse_header(data, p, None) for p in range(end, len(data))) if h is not None]
        assert all(h[3] < num for h in old)  # an earlier life: a lower segment number
        stale_tails += bool(old)
    assert stale_tails > 0, "no recycled file holds an earlier life: the check below proves nothing"

    lg2 = SegmentLog(str(tmp_path), 4096, fsync="never")
    try:
        rep = lg2.replay()
        assert rep.torn == 0
        # exactly the never-consumed groups, byte-exact, in arrival order: no consumed group
        # comes back from a recycled file's earlier life
        assert list(rep.groups) == kept
        assert all(rep.groups[k] == churn.raw[k] for k in kept)
        replayed = SeenKeys()
        for s in rep.seen:
            replayed.merge(s)
        for key in [*rep.done_keys, *rep.groups]:  # as the server recovers
            replayed.add(key)
        missing = [i for i in range(churn.seq) if ("a", i) not in replayed]
        assert missing == []  # the dedup memory survived the recycling
    finally:
        lg2.close()
    assert len(free_files(tmp_path)) <= persist.FREE_FILES


def test_free_files_adopted_after_a_restart_stay_usable(tmp_path):
    """A restarted log (here: the same process, as with ServerThread restarts or a container
    whose buffer gets the same pid) adopts the free files of its predecessor and keeps rolling
    into them. Every file the pool holds must exist, or a later roll crashes the loop."""
    seen = SeenKeys()
    churn = Churn(seen)
    lg = open_never(tmp_path, seen)
    try:
        churn.run(lg, 20)
        kept = churn.run(lg, 40, keep=range(20, 60))  # pins ~7 segments ...
        lg.append_done(kept, "consumed")  # ... released at once: the pool fills up
        settle(lg)
    finally:
        lg.close()
    assert len(free_files(tmp_path)) == persist.FREE_FILES

    lg = open_never(tmp_path, seen)
    try:
        churn.run(lg, 150)  # steady state: each roll takes a free file, each gc retires one
        pool = list(lg.pool.files)
        missing = [os.path.basename(p) for p in pool if not os.path.exists(p)]
        assert not missing and len(set(pool)) == len(pool), f"pool lists missing files {missing}: {pool}"
        churn.run(lg, 60, keep=range(churn.seq, churn.seq + 60))  # pinned: rolls drain the pool
    finally:
        lg.close()


def test_record_header_names_its_segment_and_guards_itself(tmp_path):
    lg = open_never(tmp_path, SeenKeys(), segment_bytes=1 << 20)
    raw0 = raw(0)
    lg.append_group(("a", 0), raw0)
    lg.close()
    data = open(lg.active.path, "rb").read()
    (after_seen, kind, _), (after, kind0, payload) = scan(data, lg.active.num)[0]
    assert kind == persist.SEEN_NEW and kind0 == persist.GROUP and bytes(payload) == raw0
    assert parse_header(data, after_seen, lg.active.num)[1:3] == (len(raw0), persist.GROUP)
    assert parse_header(data, after_seen, lg.active.num + 1) is None  # another life's segment number
    bad = bytearray(data)
    bad[after_seen + 9] ^= 1  # inside the length: the header's own crc catches it
    assert parse_header(bytes(bad), after_seen, lg.active.num) is None
    assert after == after_seen + HEADER.size + len(raw0)
