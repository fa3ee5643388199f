"""The buffer's by-ref data plane: groups staged in the actor's slots (``buffer.staging``) cross
the socket as ``GroupRef``s, the learner reads its batch from the segment log by ``StoredRef``,
segment files are recycled through a free pool, and compaction waits for unread refs.

Real ZeroMQ sockets and files in ``tmp_path``; only the compaction gate test stubs the log's
``compaction_due`` (pure decision logic of the server).
"""

import os
import time

import msgspec
import numpy as np
import zmq

from buffer import persist, server
from buffer.client import ActorClient, LearnerClient
from buffer.persist import HEADER, SegmentLog, parse_header, scan
from buffer.server import MAX_REFS, BufferServer
from buffer.staging import Staging, staged_seqs, staging_path
from buffer.store import SeenKeys
from buffer.synth import make_group
from buffer.testing import RawActor, ServerThread, make_config, reopen_log
from core import net
from core.messages import (BUFFER_TO_ACTOR, BUFFER_TO_LEARNER, Ack, Acks, GroupRef, GroupRefs, Hello,
                           SampleBatch, SampleRequest, decoder, encode, make_completion)

MAX_FRAME = 1 << 20  # small slots: a sparse staging file of 8 x 1 MB, not 8 x 64 MB


def cfg_small(**kw):
    return make_config(max_frame_bytes=MAX_FRAME, **kw)


def small(actor, seq, **kw):
    return make_group(actor, seq, completions=2, tokens=16, **kw)


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def stage(st: Staging, group) -> GroupRef:
    payload = encode(group)
    slot, c = st.put(group.seq, payload)
    return GroupRef(group.actor_id, group.seq, slot, len(payload), c)


def spy_ref_reads(learner: LearnerClient) -> list:
    """Record every StoredRef the learner resolves itself (the real method still runs)."""
    calls, real = [], learner._read_ref

    def read(ref):
        calls.append(ref)
        return real(ref)

    learner._read_ref = read
    return calls


def drain(learner, n, consume=True):
    got = []
    while len(got) < n:
        b = learner.sample(min(8, n - len(got)), 0, timeout_s=10)
        assert b is not None, "the buffer stopped serving"
        got += b.groups
        if consume:
            learner.consumed([g.key for g in b.groups], 0)
    return got


def raw_bytes(raw) -> bytes:
    return raw.bytes if isinstance(raw, zmq.Frame) else bytes(raw)


def assert_same_groups(got, sent):
    assert [g.key for g in got] == [g.key for g in sent]
    assert len({g.key for g in got}) == len(got), "a group was served twice"
    for g, s in zip(got, sent):
        assert g.group_id == s.group_id
        assert [c.tokens for c in g.completions] == [c.tokens for c in s.completions]
        assert [c.logprobs for c in g.completions] == [c.logprobs for c in s.completions]
        assert [c.versions for c in g.completions] == [c.versions for c in s.completions]
        assert [c.reward for c in g.completions] == [c.reward for c in s.completions]
        assert g == s  # and every other field, byte for byte


# ---- end to end through the clients ---------------------------------------------------------------


def test_round_trip_by_ref_keeps_no_group_bytes_in_the_server(tmp_path):
    cfg, run = cfg_small(), str(tmp_path)
    with ServerThread(cfg, run) as srv:
        actor = ActorClient(cfg, "a0", run_dir=run)
        learner = LearnerClient(cfg, run_dir=run)
        reads = spy_ref_reads(learner)
        try:
            assert actor.by_ref and learner.by_ref
            sent = [small("a0", actor.next_seq()) for _ in range(40)]
            for i in range(0, 40, 5):  # groups finished together: one GroupRefs per chunk
                actor.send_many(sent[i:i + 5])
            assert actor.flush(10) and actor.outstanding == 0
            wait_for(lambda: len(srv.store.resident) == 40)
            resident = dict(srv.store.resident)
            assert set(resident) == {g.key for g in sent}
            # the bytes went slot -> segment log -> learner: nothing held in the server's memory
            assert all(e.raw is None for e in resident.values())
            assert srv.invalid == {}
            assert staged_seqs(staging_path(run, "a0")) == []  # every slot freed by its ack
            got = drain(learner, 40)
            assert_same_groups(got, sent)
            assert len(reads) == 40  # each group resolved from a StoredRef, none came inline
            assert learner.sample(1, 0, timeout_s=0.3) is None  # nothing left over
            wait_for(lambda: srv.store.counters.consumed == 40)
            assert srv.store.counters.accepted == 40 and srv.store.invariant_ok()
        finally:
            actor.close()
            learner.close()


def test_round_trip_inline_with_run_dir_holds_the_bytes(tmp_path):
    cfg, run = cfg_small(), str(tmp_path)
    with ServerThread(cfg, run) as srv:
        actor = ActorClient(cfg, "a0", run_dir=run, by_ref=False)
        learner = LearnerClient(cfg, run_dir=run, by_ref=False)
        reads = spy_ref_reads(learner)
        try:
            assert not actor.by_ref and not learner.by_ref
            sent = [small("a0", actor.next_seq()) for _ in range(12)]
            for i in range(0, 12, 4):
                actor.send_many(sent[i:i + 4])
            assert actor.flush(10)
            wait_for(lambda: len(srv.store.resident) == 12)
            resident = dict(srv.store.resident)
            # inline: the server keeps each group's received frame, byte-exact
            assert all(resident[g.key].raw is not None for g in sent)
            assert all(raw_bytes(resident[g.key].raw) == encode(g) for g in sent)
            assert staged_seqs(staging_path(run, "a0")) == []  # the slots still served as the spool
            got = drain(learner, 12)
            assert_same_groups(got, sent)
            assert reads == []  # the groups came as frames
            assert srv.store.invariant_ok()
        finally:
            actor.close()
            learner.close()


def test_by_ref_actor_and_inline_learner_reads_back_from_the_log(tmp_path):
    """The server holds no bytes of a ref'd group: an inline learner gets them from the log."""
    cfg, run = cfg_small(), str(tmp_path)
    with ServerThread(cfg, run) as srv:
        actor = ActorClient(cfg, "a0", run_dir=run)
        learner = LearnerClient(cfg)  # no run_dir: a remote learner
        try:
            sent = [small("a0", actor.next_seq()) for _ in range(10)]
            actor.send_many(sent[:5])
            actor.send_many(sent[5:])
            assert actor.flush(10)
            got = drain(learner, 10)
            assert_same_groups(got, sent)
            wait_for(lambda: srv.store.counters.consumed == 10)
            assert srv.store.invariant_ok()
        finally:
            actor.close()
            learner.close()


def test_without_persistence_the_server_keeps_a_copy_and_serves_it_inline(tmp_path):
    """buffer.persist=false: no log to copy into or to point at, so the server copies the staged
    bytes before the ack frees the slot, and answers a by-ref request inline."""
    cfg, run = cfg_small(persist=False), str(tmp_path)
    with ServerThread(cfg, run) as srv:
        actor = ActorClient(cfg, "a0", run_dir=run)
        learner = LearnerClient(cfg, run_dir=run)
        reads = spy_ref_reads(learner)
        try:
            assert actor.by_ref and learner.by_ref
            sent = [small("a0", actor.next_seq()) for _ in range(8)]
            actor.send_many(sent)
            assert actor.flush(10)
            wait_for(lambda: len(srv.store.resident) == 8)
            assert all(raw_bytes(srv.store.resident[g.key].raw) == encode(g) for g in sent)
            # the slots are free and may be overwritten: the server's copies must not change
            actor.send_many([small("a0", actor.next_seq(), group_id="overwrites") for _ in range(8)])
            assert actor.flush(10)
            got = drain(learner, 8)
            assert_same_groups(got, sent)
            assert reads == []
        finally:
            actor.close()
            learner.close()


# ---- refs against real staging slots -------------------------------------------------------------


def test_refs_checked_against_the_slot_and_a_resent_ref_after_slot_reuse(tmp_path):
    cfg, run = cfg_small(), str(tmp_path)
    st = Staging(staging_path(run, "a0"), "a0", 4, MAX_FRAME)
    with ServerThread(cfg, run) as srv:
        raw = RawActor(cfg)
        learner = LearnerClient(cfg, run_dir=run)
        try:
            g0, g1 = small("a0", 0), small("a0", 1)
            ref0 = stage(st, g0)
            raw.send(ref0)
            assert raw.recv() == Ack("a0", 0, "ok")
            # the actor frees the slot on the ack and stages its next group there
            st.release(ref0.slot)
            ref1 = stage(st, g1)
            assert ref1.slot == ref0.slot
            raw.send(ref0)  # a late resend of the old ref: answered from the key, slot not read
            assert raw.recv() == Ack("a0", 0, "duplicate")
            raw.send(ref1)
            assert raw.recv() == Ack("a0", 1, "ok")

            bad = {
                "ref_mismatch": GroupRef("a0", 2, ref1.slot, ref1.length, ref1.crc),  # slot holds seq 1
                "ref_bounds": GroupRef("a0", 5, st.nslots, ref1.length, ref1.crc),
                "ref_unreadable": GroupRef("ghost", 0, 0, ref1.length, ref1.crc),  # no staging file
                "oversize": GroupRef("a0", 6, 0, MAX_FRAME + 1, 0),
                "negative_id": GroupRef("a0", -1, 0, ref1.length, ref1.crc),
                "bad_actor_id": GroupRef("x" * 200, 0, 0, ref1.length, ref1.crc),
            }
            for reason, ref in bad.items():
                raw.send(ref)
                ack = raw.recv()
                assert (ack.status, ack.reason) == ("rejected", reason), reason
            # a known key is answered from the key alone, whatever the ref says about its slot
            raw.send(GroupRef("a0", 1, ref1.slot, ref1.length, ref1.crc ^ 1))
            assert raw.recv() == Ack("a0", 1, "duplicate")
            # right slot, seq and length but the wrong crc: refused before a byte is trusted
            g3 = small("a0", 3)
            ref3 = stage(st, g3)
            raw.send(GroupRef("a0", 3, ref3.slot, ref3.length, ref3.crc ^ 1))
            assert raw.recv() == Ack("a0", 3, "rejected", "ref_mismatch")

            # a slot whose bytes decode fine but fail validation: same checks as inline
            nan = make_completion(np.arange(4), [-0.5, float("nan"), -0.1, -0.2], [0] * 4, "stop", 1.0)
            g4 = msgspec.structs.replace(small("a0", 4), completions=[nan])
            raw.send(stage(st, g4))
            assert raw.recv() == Ack("a0", 4, "rejected", "nonfinite_logprob")

            assert srv.invalid == {"ref_mismatch": 2, "ref_bounds": 1, "ref_unreadable": 1, "oversize": 1,
                                   "negative_id": 1, "bad_actor_id": 1, "nonfinite_logprob": 1}
            assert srv.store.counters.accepted == 2 and srv.store.counters.duplicates == 2
            raw.send(Hello("actor", "a0"))
            assert raw.recv() == Ack("a0", 2, "hello")  # no rejected ref marked its key seen
            # what was logged under each key is that key's group, not the slot's later content
            got = drain(learner, 2)
            assert_same_groups(got, [g0, g1])
        finally:
            raw.close()
            learner.close()
    st.close()


def test_group_refs_over_max_refs_is_refused_whole_and_the_server_keeps_serving(tmp_path):
    cfg, run = cfg_small(), str(tmp_path)
    st = Staging(staging_path(run, "a0"), "a0", 4, MAX_FRAME)
    with ServerThread(cfg, run) as srv:
        raw = RawActor(cfg)
        try:
            g0, g1 = small("a0", 0), small("a0", 1)
            r0, r1 = stage(st, g0), stage(st, g1)
            # refs to real slots among them: none of them may be taken from an oversized message
            raw.send(GroupRefs([r0, r1] + [GroupRef("ghost", i, 0, 10, 0) for i in range(MAX_REFS - 1)]))
            # exactly MAX_REFS is still a legal message: every ref answered
            raw.send(GroupRefs([GroupRef("ghost", i, 0, 10, 0) for i in range(MAX_REFS)]))
            acks = [raw.recv() for _ in range(MAX_REFS)]
            # the first answer belongs to the second message: the oversized one got none
            assert all(a.actor_id == "ghost" and a.reason == "ref_unreadable" for a in acks)
            assert sorted(a.seq for a in acks) == list(range(MAX_REFS))
            raw.send(GroupRefs([r0, r1]))
            assert [raw.recv(), raw.recv()] == [Ack("a0", 0, "ok"), Ack("a0", 1, "ok")]
            assert srv.invalid == {"too_many_refs": 1, "ref_unreadable": MAX_REFS}
            assert srv.store.counters.accepted == 2 and srv.store.counters.duplicates == 0
        finally:
            raw.close()
    st.close()


def test_actor_restarts_from_its_slots_while_the_buffer_was_down(tmp_path):
    cfg, run = cfg_small(), str(tmp_path)
    path = staging_path(run, "a0")
    first = ServerThread(cfg, run)
    first.__enter__()
    actor = ActorClient(cfg, "a0", run_dir=run, window=8, resend_s=0.5)
    try:
        seqs = [actor.next_seq()]  # the buffer's Hello answer starts the numbering
        first.stop()  # buffer gone: nothing below can be acked (stop() is idempotent)
        seqs += [actor.next_seq() for _ in range(4)]  # from the counter reserved in the staging file
        sent = [small("a0", s) for s in seqs]
        actor.send_many(sent[:2])
        actor.send_many(sent[2:])
        assert actor.outstanding == 5
    finally:
        actor.close()  # the actor dies with its window unacked
        first.stop()
    assert staged_seqs(path) == seqs == list(range(5))

    with ServerThread(cfg, run) as srv:
        again = ActorClient(cfg, "a0", run_dir=run, window=8, resend_s=0.5)
        learner = LearnerClient(cfg, run_dir=run)
        reads = spy_ref_reads(learner)
        try:
            assert again.outstanding == 5  # picked up from the slots
            assert again.flush(10)
            assert staged_seqs(path) == []
            assert again.next_seq() not in seqs  # a seq is never reused for another group
            got = drain(learner, 5)
            assert_same_groups(got, sent)
            assert len(reads) == 5
            assert learner.sample(1, 0, timeout_s=0.3) is None  # each exactly once
            assert srv.store.counters.accepted == 5 and srv.store.invariant_ok()
        finally:
            again.close()
            learner.close()


# ---- the segment log: recycled files -------------------------------------------------------------


def open_log(d, seen, segment_bytes=4096):
    return reopen_log(d, segment_bytes, seen, fsync="never")[:2]


def settle(lg):
    """Let the I/O thread write, then gc and wait until the deleted segments are retired (the
    thread renames them into the free pool): the next roll then finds a free file."""
    lg.commit()
    before = set(lg.segments)
    lg.gc()
    gone = before - set(lg.segments)
    wait_for(lambda: not any(os.path.exists(lg.seg_path(n)) for n in gone), timeout=5)


def free_files(d):
    return sorted(n for n in os.listdir(d) if n.startswith("free-") and n.endswith(".log"))


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
    lg, _ = open_log(tmp_path, seen)
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
        lg.commit()
        for key in kept:  # where / read locate the exact bytes appended
            num, offset, n = lg.where(key)
            assert n == len(churn.raw[key])
            assert lg.read(key) == churn.raw[key]
            with open(lg.seg_path(num), "rb") as f:
                data = f.read()
            assert data[offset + HEADER.size:offset + HEADER.size + n] == churn.raw[key]
        assert lg.where(("a", 1)) is None  # consumed: no longer located
    finally:
        lg.close()
    assert len(free_files(tmp_path)) <= persist.FREE_FILES

    # some segment file is a recycled one with intact records of an earlier life after this life's
    stale_tails = 0
    for name in sorted(n for n in os.listdir(tmp_path) if n.startswith("seg-")):
        num = int(name[4:-4])
        with open(tmp_path / name, "rb") as f:
            data = f.read()
        _, end, torn = scan(data, num)
        assert not torn
        old = [h for h in (parse_header(data, p, None) for p in range(end, len(data))) if h is not None]
        assert all(h[3] < num for h in old)  # an earlier life: a lower segment number
        stale_tails += bool(old)
    assert stale_tails > 0, "no recycled file holds an earlier life: the check below proves nothing"

    replayed = SeenKeys()
    lg2 = SegmentLog(str(tmp_path), 4096, fsync="never")
    try:
        rep = lg2.replay()
        assert rep.corrupt == 0
        # exactly the never-consumed groups, byte-exact, in arrival order: no consumed group
        # comes back from a recycled file's earlier life
        assert list(rep.groups) == kept
        assert all(rep.groups[k] == churn.raw[k] for k in kept)
        for key in kept:
            assert lg2.read(key) == churn.raw[key]
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
    lg, _ = open_log(tmp_path, seen)
    try:
        churn.run(lg, 20)
        kept = churn.run(lg, 40, keep=range(20, 60))  # pins ~7 segments ...
        lg.append_done(kept, "consumed")  # ... released at once: the pool fills up
        settle(lg)
    finally:
        lg.close()
    assert len(free_files(tmp_path)) == persist.FREE_FILES

    lg, _ = open_log(tmp_path, seen)
    try:
        churn.run(lg, 150)  # steady state: each roll takes a free file, each gc retires one
        pool = list(lg.pool.files)
        missing = [os.path.basename(p) for p in pool if not os.path.exists(p)]
        assert not missing and len(set(pool)) == len(pool), (
            f"BUG buffer/persist.py _FreePool.retire: names free-<pid>-<n>.log with a counter that "
            f"restarts at 0, so it renamed a segment over a free file adopted from the previous "
            f"log in this pid; the pool now lists {missing} which no longer exist (pool {pool})")
        try:
            churn.run(lg, 60, keep=range(churn.seq, churn.seq + 60))  # pinned: rolls drain the pool
        except FileNotFoundError as e:
            raise AssertionError(f"BUG: a roll took a free file that no longer exists: {e}") from e
    finally:
        lg.close()


# ---- the server: refs to learners and the compaction gate ----------------------------------------


def test_compaction_waits_for_unread_refs(tmp_path, monkeypatch):
    srv = BufferServer(cfg_small(), str(tmp_path))
    try:
        calls = []
        real = srv.log.compact

        def compact(resident):
            calls.append(1)
            real(resident)

        monkeypatch.setattr(srv.log, "compaction_due", lambda: True)
        monkeypatch.setattr(srv.log, "compact", compact)
        srv._unread = {b"x": (1, time.monotonic())}
        srv._maybe_compact()
        assert calls == [] and b"x" in srv._unread  # a learner may still be reading old segments
        srv._unread = {b"x": (1, time.monotonic() - server.UNREAD_REFS_S - 1)}
        srv._maybe_compact()
        assert calls == [1] and srv._unread == {}  # it has had its time: taken to have read them
        srv._maybe_compact()
        assert calls == [1, 1]
    finally:
        srv.close()


def test_a_by_ref_batch_marks_its_learner_unread_until_it_says_it_read_it(tmp_path):
    """Driven turn by turn: a by-ref batch holds StoredRefs to the exact logged bytes and gates
    compaction until a request of that learner says it read the batch (``read_through``) -- a
    new request alone is no proof, the batch may still sit unread in its socket; an inline
    batch never gates it."""
    cfg = cfg_small()
    srv = BufferServer(cfg, str(tmp_path))
    ctx = zmq.Context()
    socks = []

    def dealer(port):
        s = net.socket(ctx, zmq.DEALER)
        net.connect(s, cfg.net.host, port)
        socks.append(s)
        return s

    def answer(sock):
        for _ in range(200):
            srv.step(10)
            if sock.poll(0):
                return sock.recv_multipart()
        raise AssertionError("no answer from the buffer")

    try:
        actor, by_ref, inline = dealer(srv.actor_port), dealer(srv.learner_port), dealer(srv.learner_port)
        groups = [small("a0", i) for i in range(3)]
        for g in groups:
            actor.send(encode(g))
        acks = decoder(BUFFER_TO_ACTOR)
        got = []
        while len(got) < 3:
            msg = acks.decode(answer(actor)[0])
            got += list(msg.acks) if isinstance(msg, Acks) else [msg]
        assert [a.status for a in got] == ["ok"] * 3

        batches = decoder(BUFFER_TO_LEARNER)
        by_ref.send(encode(SampleRequest(1, 2, 0, by_ref=True)))
        frames = answer(by_ref)
        batch = batches.decode(frames[0])
        assert isinstance(batch, SampleBatch) and len(frames) == 1 and batch.groups == []
        assert len(batch.refs) == 2
        for ref, g in zip(batch.refs, groups):
            with open(os.path.join(str(tmp_path), "buffer", persist.seg_name(ref.seg)), "rb") as f:
                data = f.read()
            h = parse_header(data, ref.offset, ref.seg)
            assert h is not None and h[1] == ref.length == len(encode(g))
            start = ref.offset + HEADER.size
            assert data[start:start + ref.length] == encode(g)
        ident = next(i for i, st in srv._learners.items() if st.answered == 1)
        assert set(srv._unread) == {ident}

        inline.send(encode(SampleRequest(1, 1, 0)))
        frames = answer(inline)
        assert len(frames) == 2 and frames[1] == encode(groups[2])  # the bytes, read back from the log
        assert set(srv._unread) == {ident}  # an inline batch leaves nothing to read later

        by_ref.send(encode(SampleRequest(2, 1, 0, by_ref=True)))  # a new request, batch 1 not yet read
        for _ in range(20):
            srv.step(10)
        assert set(srv._unread) == {ident}
        by_ref.send(encode(SampleRequest(3, 1, 0, by_ref=True, read_through=1)))  # now it has
        for _ in range(200):
            srv.step(10)
            if not srv._unread:
                break
        assert srv._unread == {}
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        srv.close()


def test_compaction_under_a_by_ref_stream_moves_records_without_breaking_the_learner(tmp_path):
    """One group the learner holds unconsumed pins an old segment while 150 more stream through
    tiny segments, so compactions run mid-stream: refs served before and after each compaction
    resolve to the right bytes, and the compacted log replays to the same state. (The gate that
    keeps a compaction from moving records a learner has not read yet is tested above, turn by
    turn: here the learner reads each batch at once, so the race it closes does not arise.)"""
    cfg, run = cfg_small(segment_bytes=8 << 10), str(tmp_path)
    with ServerThread(cfg, run) as srv:
        actor = ActorClient(cfg, "a0", run_dir=run)
        learner = LearnerClient(cfg, run_dir=run)
        try:
            first = small("a0", actor.next_seq())
            actor.send(first)
            held = drain(learner, 1, consume=False)  # leased, never consumed: pins its segment
            assert_same_groups(held, [first])
            sent = []
            for _ in range(30):
                chunk = [small("a0", actor.next_seq()) for _ in range(5)]
                actor.send_many(chunk)
                sent += chunk
                assert_same_groups(drain(learner, 5), chunk)
            assert actor.flush(10)
            assert srv.log.compactions > 0  # the pinned segment made old ones pile up
            learner.consumed([first.key], 0)
            wait_for(lambda: srv.store.counters.consumed == 151)
            assert not srv.store.resident and srv.store.invariant_ok()
        finally:
            actor.close()
            learner.close()
    with ServerThread(cfg, run) as replayed:  # and the compacted log replays to the same state
        assert not replayed.store.resident
        assert all(k in replayed.store.seen for k in [first.key] + [g.key for g in sent])
