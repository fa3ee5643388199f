"""The actor and learner protocols over real ZeroMQ sockets, against a server in a thread: acks,
held requests, capacity, staleness, restarts of either side, the actor's spool, and the one data
path (group bytes in the frames, forwarded to the learner exactly as the actor sent them)."""

import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from buffer.client import ActorClient, LearnerClient, Spool, spool_path
from core import net
from core.messages import (ACTOR_TO_BUFFER, BUFFER_TO_LEARNER, LEARNER_TO_BUFFER, Ack, Consumed, Hello,
                           RolloutGroup, SampleBatch, SampleRequest, decoder, encode, MAX_GROUPS_PER_MSG)
from tests.support.buffer import ROOT, RawActor, ServerThread, make_config, token, wait_for
from tests.support.synth import make_group


def small(actor, seq, version=0, **kw):
    return make_group(actor, seq, completions=2, tokens=16, version=version, **kw)


def drain(learner, n, consume=True):
    got = []
    while len(got) < n:
        b = learner.sample(min(8, n - len(got)), 0, timeout_s=10)
        assert b is not None, "the buffer stopped serving"
        got += b.groups
        if consume:
            learner.consumed([g.key for g in b.groups], 0)
    return got


def test_stream_sample_consume_and_metrics(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    reports = []
    with ServerThread(cfg, str(tmp_path), metrics=reports.append) as srv:
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        sent = [small("a0", actor.next_seq()) for _ in range(20)]
        for g in sent:
            actor.send(g)
        assert actor.flush(10) and actor.outstanding == 0
        got = []
        while len(got) < 20:
            batch = learner.sample(min(8, 20 - len(got)), 0, timeout_s=10)
            got += batch.groups
            learner.consumed([g.key for g in batch.groups], 0)
        assert [g.key for g in got] == [g.key for g in sent]  # oldest first, nothing twice
        assert got == sent  # every field of every group, byte-exact
        wait_for(lambda: srv.store.counters.consumed == 20)
        wait_for(lambda: reports and reports[-1]["buffer/consumed"] == 20, timeout=5)
        r = reports[-1]
        for key in ("buffer/depth", "buffer/depth_bytes", "buffer/accepted", "buffer/consumed",
                    "buffer/dropped_stale", "buffer/dropped_invalid", "buffer/duplicates", "buffer/busy",
                    "buffer/invariant_ok"):
            assert key in r
        assert r["buffer/accepted"] == 20 and r["buffer/depth"] == 0 and r["buffer/invariant_ok"] == 1.0
        actor.close()
        learner.close()


def test_ack_statuses_ok_duplicate_rejected_and_hello_seq(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = RawActor(cfg)
        assert raw.hello("r") == Ack("r", 0, "hello")
        g = small("r", 0)
        raw.send(g)
        raw.send(g)  # a resend
        assert [raw.recv().status, raw.recv().status] == ["ok", "duplicate"]
        bad = msgspec.structs.replace(g, seq=1, completions=[msgspec.structs.replace(
            g.completions[0], logprobs=g.completions[0].logprobs[:-4]), g.completions[1]])
        raw.send(bad)
        assert raw.recv() == Ack("r", 1, "rejected", "length_mismatch")
        assert raw.hello("r") == Ack("r", 1, "hello")  # numbering resumes after the accepted seq 0
        assert srv.store.counters.duplicates == 1 and srv.invalid["length_mismatch"] == 1
        raw.close()


def test_busy_blocks_the_actor_until_the_learner_makes_room(tmp_path):
    cfg = make_config(run_dir=tmp_path, capacity_groups=2)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor = ActorClient(cfg, "a0")
        got = []

        def drain():
            learner = LearnerClient(cfg)
            while len(got) < 6:
                b = learner.sample(1, 0, timeout_s=20)
                got.extend(g.key for g in b.groups)
                time.sleep(0.05)  # a slow learner: the buffer fills up
                learner.consumed([g.key for g in b.groups], 0)
            learner.close()

        t = threading.Thread(target=drain)
        t.start()
        for _ in range(6):
            actor.send(small("a0", actor.next_seq()))
        assert actor.flush(20)
        t.join(30)
        assert sorted(got) == [("a0", i) for i in range(6)]
        assert srv.store.counters.busy > 0 and actor.admission_wait_s > 0
        actor.close()


def test_stale_on_arrival_rejected_and_accepted_then_dropped_both_reach_the_actor(tmp_path):
    cfg = make_config(run_dir=tmp_path, max_staleness=1)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        actor.send(small("a0", actor.next_seq(), version=0))  # learner version unknown: accepted
        assert actor.flush(10)
        assert learner.sample(1, 5, timeout_s=0.5) is None  # at v=5 it is stale: dropped, not served
        wait_for(lambda: srv.store.counters.dropped["stale"] == 1)
        notices = []
        wait_for(lambda: notices.extend(actor.poll(50)) or notices)
        assert [(a.seq, a.status, a.reason) for a in notices] == [(0, "dropped", "stale")]
        actor.send(small("a0", actor.next_seq(), version=2))  # stale on arrival now that v=5 is known
        assert actor.flush(10)
        notices = []
        wait_for(lambda: notices.extend(actor.poll(50)) or notices)
        assert [(a.seq, a.status, a.reason) for a in notices] == [(1, "rejected", "stale")]
        s = srv.stats()
        assert s["buffer/dropped_stale"] == 2 and s["funnel/len/<=64"] == 2
        assert s["buffer/invariant_ok"] == 1.0
        actor.close()
        learner.close()


def test_request_is_held_until_enough_groups_then_answered_once(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)):
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        assert learner.sample(3, 0, timeout_s=0.3) is None
        actor.send(small("a0", actor.next_seq()))
        actor.send(small("a0", actor.next_seq()))
        assert actor.flush(10)
        assert learner.sample(3, 0, timeout_s=0.3) is None  # 2 < 3: still held
        actor.send(small("a0", actor.next_seq()))
        batch = learner.sample(3, 0, timeout_s=10)
        assert batch.request_id == 1 and len(batch.groups) == 3  # the very first request, answered late
        actor.close()
        learner.close()


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_stale_strategy_wait_holds_the_learner_for_groups_its_next_step_would_make_stale(tmp_path, strategy):
    cfg = make_config(run_dir=tmp_path, max_staleness=1, stale_strategy=strategy, stale_wait_s=1.5)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        assert learner.sample(1, 1, timeout_s=0.3) is None  # the buffer learns the learner's version
        for _ in range(2):
            actor.send(small("a0", actor.next_seq(), version=1))
        assert actor.flush(10)
        actor.in_flight(1)  # a batch started at version 1 is being generated
        wait_for(lambda: strategy == "drop" or "a0" in srv.stale_wait._oldest)
        # at version 1 the next step makes version-1 groups 1 stale: within the bound, nothing to wait for
        assert len(learner.sample(1, 1, timeout_s=10).groups) == 1
        # at version 2 it makes them 2 stale: wait holds the learner until they are in
        got = learner.sample(1, 2, timeout_s=0.6)
        assert (got is None) == (strategy == "wait")
        if strategy == "drop":
            return
        actor.in_flight(-1)
        assert len(learner.sample(1, 2, timeout_s=10).groups) == 1
        # an actor that never finishes is waited for stale_wait_s, then forgotten (counted)
        actor.send(small("a0", actor.next_seq(), version=2))
        actor.in_flight(2)
        assert actor.flush(10)
        wait_for(lambda: srv.stale_wait._oldest.get("a0", [None])[0] == 2)  # (the learner's socket is read first)
        t0 = time.monotonic()
        assert len(learner.sample(1, 3, timeout_s=10).groups) == 1
        assert time.monotonic() - t0 >= 1.4
        assert (srv.stale_wait.held, srv.stale_wait.timeouts) == (2, 1)
        actor.close()
        learner.close()


def test_full_buffer_serves_a_partial_batch_instead_of_deadlocking(tmp_path):
    one = len(encode(small("a0", 0)))
    cfg = make_config(run_dir=tmp_path, capacity_bytes=int(2.5 * one))
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = RawActor(cfg, "a0")
        for i in range(3):
            raw.send(small("a0", i))
        assert [raw.recv().status for _ in range(3)] == ["ok", "ok", "busy"]
        learner = LearnerClient(cfg)
        batch = learner.sample(8, 0, timeout_s=10)
        assert [g.seq for g in batch.groups] == [0, 1]
        assert srv.store.leased == 2
        raw.close()
        learner.close()


def test_the_groups_of_one_message_are_judged_each_alone_and_before_what_follows_them(tmp_path):
    """An actor message's groups are validated together (one pass), yet each gets its own answer, in
    order, and a Hello after them in the same message is answered as if they had come alone."""
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = RawActor(cfg, "a0")
        bad = small("a0", 1)
        bad = msgspec.structs.replace(bad, completions=bad.completions[:1])  # the group size is 2
        frames = [encode(g) for g in (small("a0", 0), bad, small("a0", 2))]
        raw.sock.send_multipart(frames + [encode(Hello("actor", "a0", token=token(cfg)))])
        acks = [raw.recv() for _ in range(4)]
        assert [(a.seq, a.status, a.reason) for a in acks] == [(0, "ok", ""), (1, "rejected", "group_size"),
                                                                (2, "ok", ""), (3, "hello", "")]
        assert srv.store.counters.accepted == 2 and srv.invalid["group_size"] == 1
        raw.close()


def test_restarted_learner_gets_back_what_it_held_but_never_consumed(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)):
        actor = ActorClient(cfg, "a0")
        for _ in range(4):
            actor.send(small("a0", actor.next_seq()))
        assert actor.flush(10)
        first = LearnerClient(cfg, learner_id="L")
        held = first.sample(2, 0, timeout_s=10)
        first.consumed([held.groups[0].key], 0)
        first.close()  # dies holding groups[1] unconsumed
        second = LearnerClient(cfg, learner_id="L")
        keys = []
        while len(keys) < 3:
            keys += [g.key for g in second.sample(1, 0, timeout_s=10).groups]
        assert sorted(keys) == [("a0", 1), ("a0", 2), ("a0", 3)]
        actor.close()
        second.close()


def test_buffer_restart_keeps_unconsumed_and_leased_groups_and_the_seq_high_water_mark(tmp_path):
    cfg = make_config(run_dir=tmp_path, fsync="always")
    with ServerThread(cfg, str(tmp_path)):
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        for _ in range(5):
            actor.send(small("a0", actor.next_seq()))
        assert actor.flush(10)
        b = learner.sample(3, 0, timeout_s=10)
        learner.consumed([b.groups[0].key], 0)
        learner.sample(1, 0, timeout_s=0.0)  # flushes the Consumed
        time.sleep(0.3)
        actor.close()
        learner.close()
    with ServerThread(cfg, str(tmp_path)) as srv:
        assert sorted(srv.store.resident) == [("a0", i) for i in (1, 2, 3, 4)]
        assert ("a0", 0) in srv.store.seen and srv.store.counters.recovered == 4
        fresh = ActorClient(cfg, "a0")  # no spool: asks the buffer where to resume
        assert fresh.next_seq() == 5
        fresh.close()


def test_learner_client_never_returns_a_key_twice_and_re_sends_a_lost_consumed(tmp_path):
    """Scripted buffer that 'forgot' a Consumed (as after a crash) and serves the group again."""
    cfg = make_config(run_dir=tmp_path)
    ctx = zmq.Context()
    router = net.socket(ctx, zmq.ROUTER)
    net.bind(router, "127.0.0.1", cfg.net.buffer_learner_port)
    dec = decoder(LEARNER_TO_BUFFER)
    learner = LearnerClient(cfg, resend_s=0.2)
    g0, g1, g2 = (small("a0", i) for i in range(3))
    out = {}

    def fake_buffer():
        seen = []
        while len(seen) < 6:
            if not router.poll(5000):
                break
            ident, frame = router.recv_multipart()
            msg = dec.decode(frame)
            seen.append(msg)
            if isinstance(msg, SampleRequest) and msg.request_id == 1:
                router.send_multipart([ident, encode(SampleBatch(1, [g0, g1]))])
            elif isinstance(msg, SampleRequest) and msg.request_id == 2:
                router.send_multipart([ident, encode(SampleBatch(2, [g1, g0, g2]))])
                break
        time.sleep(0.3)
        while router.poll(100):
            seen.append(dec.decode(router.recv_multipart()[1]))
        out["seen"] = seen

    t = threading.Thread(target=fake_buffer)
    t.start()
    first = learner.sample(2, 0, timeout_s=5)
    learner.consumed([g0.key], 0)  # g1 is still being trained on
    second = learner.sample(2, 0, timeout_s=5)
    t.join(10)
    assert [g.key for g in first.groups] == [g0.key, g1.key]
    assert [g.key for g in second.groups] == [g2.key]
    assert learner.filtered == 2
    consumed = [m.keys for m in out["seen"] if isinstance(m, Consumed)]
    assert consumed == [[g0.key], [g0.key]]  # the original and the re-send; g1 not (not trained yet)
    learner.close()
    router.close()
    ctx.term()


def test_actor_client_refuses_groups_of_another_actor(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    actor = ActorClient(cfg, "a0")
    with pytest.raises(ValueError, match="a1"):
        actor.send(small("a1", 0))
    actor.close()


def test_persist_false_serves_from_memory_and_keeps_nothing_on_disk(tmp_path):
    cfg = make_config(run_dir=tmp_path, persist=False)
    with ServerThread(cfg, str(tmp_path)):
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        sent = [small("a0", actor.next_seq()) for _ in range(6)]
        actor.send_many(sent)
        assert actor.flush(10)
        assert drain(learner, 6) == sent
        actor.close()
        learner.close()
    assert not (tmp_path / "buffer").exists()
    with ServerThread(cfg, str(tmp_path)) as srv:
        assert not srv.store.resident and ("a0", 0) not in srv.store.seen


def test_buffer_package_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import buffer.server, buffer.client, buffer.store, buffer.durable, buffer.policies\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_learner_receives_the_actor_bytes_and_reassembles_a_sample_batch(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    sent = [make_group("a0", i, completions=2, tokens=16) for i in range(3)]
    with ServerThread(cfg, str(tmp_path)):
        actor = ActorClient(cfg, "a0")
        for g in sent:
            actor.send(g)
        assert actor.flush(10)
        ctx = zmq.Context()
        raw = net.socket(ctx, zmq.DEALER)
        net.connect(raw, "127.0.0.1", cfg.net.buffer_learner_port)
        raw.send(encode(Hello("learner", "raw", token=token(cfg))))
        raw.send(encode(SampleRequest(1, 2, 0)))
        assert raw.poll(5000)
        frames = raw.recv_multipart()
        head = decoder(BUFFER_TO_LEARNER).decode(frames[0])
        assert isinstance(head, SampleBatch) and head.request_id == 1 and head.groups == []
        assert frames[1:] == [encode(g) for g in sent[:2]]  # byte for byte what the actor sent
        raw.close()
        ctx.term()
        learner = LearnerClient(cfg)  # the raw learner left without consuming: all three are back
        batch = learner.sample(3, 0, timeout_s=5)
        assert isinstance(batch, SampleBatch) and batch.groups == sent
        assert isinstance(batch.groups[0], RolloutGroup)
        learner.close()
        actor.close()


class SilentBuffer:
    """Answers the Hello, records every group frame, acks only once told to."""

    def __init__(self, cfg):
        self.ctx = zmq.Context()
        self.sock = net.socket(self.ctx, zmq.ROUTER)
        net.bind(self.sock, "127.0.0.1", cfg.net.buffer_actor_port)
        self.dec = decoder(ACTOR_TO_BUFFER)
        self.arrivals: list[int] = []
        self.messages = 0  # group-carrying messages received
        self.ack_from = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        unacked = []
        while not self.stop.is_set():
            if self.sock.poll(20):
                ident, *frames = self.sock.recv_multipart()  # a message carries one group or more
                self.messages += not isinstance(self.dec.decode(frames[0]), Hello)
                for msg in map(self.dec.decode, frames):
                    if isinstance(msg, Hello):
                        self.sock.send_multipart([ident, encode(Ack(msg.id, 0, "hello"))])
                        continue
                    self.arrivals.append(msg.seq)
                    unacked.append((ident, msg))
            if self.ack_from.is_set():
                for ident, msg in unacked:
                    self.sock.send_multipart([ident, encode(Ack(msg.actor_id, msg.seq, "ok"))])
                unacked.clear()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def test_groups_handed_over_together_travel_as_one_message(tmp_path):
    """send_many puts every group that fits the window into one ZeroMQ message (one wake-up, one
    commit and one Acks at the buffer for all of them), the rest into a second once acks make room."""
    cfg = make_config(run_dir=tmp_path)
    buf = SilentBuffer(cfg)
    actor = ActorClient(cfg, "a0", window=4, resend_s=30)
    try:
        groups = [make_group("a0", actor.next_seq(), completions=1, tokens=4) for _ in range(3)]
        actor.send_many(groups)
        wait_for(lambda: len(buf.arrivals) == 3)
        assert buf.arrivals == [0, 1, 2] and buf.messages == 1
        buf.ack_from.set()
        assert actor.flush(5)
        actor.send_many([make_group("a0", actor.next_seq(), completions=1, tokens=4) for _ in range(4)])
        assert actor.flush(5) and buf.messages == 2  # the window's worth: one message
        actor.send_many([make_group("a0", actor.next_seq(), completions=1, tokens=4) for _ in range(6)])
        assert actor.flush(5)
        assert buf.arrivals == list(range(13)) and buf.messages >= 4  # more than a window: never one message
    finally:
        actor.close()
        buf.close()


def test_the_server_takes_each_group_of_a_message_on_its_own_merits(tmp_path):
    """One message of several groups: each is validated, stored and acked by itself (a bad one in
    the middle costs only itself); one of more groups than MAX_GROUPS_PER_MSG is refused whole."""
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = RawActor(cfg, "a0")
        bad = msgspec.structs.replace(small("a0", 1), schema_version=0)
        raw.sock.send_multipart([encode(small("a0", 0)), encode(bad), encode(small("a0", 2))])
        acks = sorted(((a.seq, a.status, a.reason) for a in (raw.recv() for _ in range(3))))
        assert acks == [(0, "ok", ""), (1, "rejected", "schema_version"), (2, "ok", "")]
        raw.sock.send_multipart([encode(small("a0", 10 + i)) for i in range(MAX_GROUPS_PER_MSG + 1)])
        wait_for(lambda: srv.invalid["multipart"] == 1)
        assert srv.store.counters.accepted == 2 and sorted(srv.store.resident) == [("a0", 0), ("a0", 2)]
        raw.close()


def test_actor_client_resends_unacked_groups_and_keeps_to_its_window(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    buf = SilentBuffer(cfg)
    actor = ActorClient(cfg, "a0", window=3, resend_s=0.2)
    try:
        for _ in range(3):  # fills the window without blocking
            actor.send(make_group("a0", actor.next_seq(), completions=1, tokens=4))
        assert not actor.flush(0.7)  # nothing acked: every group is resent every 0.2 s
        assert sorted(set(buf.arrivals)) == [0, 1, 2]
        assert all(buf.arrivals.count(s) >= 2 for s in range(3))
        buf.ack_from.set()
        actor.send(make_group("a0", actor.next_seq(), completions=1, tokens=4))  # waited for room
        assert actor.flush(5) and actor.outstanding == 0
        first_3 = buf.arrivals.index(3)
        assert first_3 > buf.arrivals.index(2)  # seq 3 only went out once the window had room
    finally:
        actor.close()
        buf.close()


# ---- the actor's spool ----------------------------------------------------------------------------


def test_unacked_groups_survive_the_actor_and_are_resent_by_its_next_incarnation(tmp_path):
    """Groups sent while the buffer is down stay in the spool when the actor dies; the next
    incarnation resends them, numbers new groups above them, and each is trained on once."""
    cfg, run = make_config(run_dir=tmp_path), str(tmp_path)
    first = ServerThread(cfg, run)
    first.__enter__()
    actor = ActorClient(cfg, "a0", run_dir=run, window=8, resend_s=0.5)
    try:
        acked = [small("a0", actor.next_seq())]  # the buffer's Hello answer starts the numbering
        actor.send(acked[0])
        assert actor.flush(10)
        first.stop()  # buffer gone: nothing below can be acked
        spooled = [small("a0", actor.next_seq()) for _ in range(5)]
        actor.send_many(spooled[:2])
        actor.send_many(spooled[2:])
        assert actor.outstanding == 5
    finally:
        actor.close()  # the actor dies with its window unacked
        first.stop()
    assert [s for s, _ in Spool(spool_path(run, "a0"), "a0").pending()] == [1, 2, 3, 4, 5]
    assert len(os.listdir(spool_path(run, "a0"))) == 1  # one file, a record per send_many

    with ServerThread(cfg, run) as srv:
        again = ActorClient(cfg, "a0", run_dir=run, window=8, resend_s=0.5)
        learner = LearnerClient(cfg)
        try:
            assert again.outstanding == 5  # picked up from the spool
            assert again.next_seq() == 6  # and numbering resumes above it
            assert again.flush(10)
            assert os.listdir(spool_path(run, "a0")) == []  # the earlier life's file deleted by its last ack
            assert drain(learner, 6) == acked + spooled
            assert learner.sample(1, 0, timeout_s=0.3) is None  # each exactly once
            assert srv.store.counters.accepted == 6 and srv.store.invariant_ok()
        finally:
            again.close()
            learner.close()


def record(*payloads) -> bytes:
    """A spool record as Spool.put writes it: its size, then a msgpack list of encoded groups."""
    body = msgspec.msgpack.encode(list(payloads))
    return len(body).to_bytes(8, "little") + body


def test_spool_keeps_a_file_until_its_last_group_settles_and_drops_what_was_never_sent(tmp_path):
    d = str(tmp_path / "spool")
    sp = Spool(d, "a0")
    chunk = [small("a0", 3), small("a0", 4)]
    sp.put([3, 4], [encode(g) for g in chunk])
    sp.close()  # the actor dies: its file stays
    (name,) = os.listdir(d)
    g13 = encode(small("a0", 13))
    junk = {"9.groups.tmp123": record(encode(small("a0", 9))),  # not a spool file
            "10.groups": record(encode(small("a0", 10)))[:-7],  # its only record cut short
            "11.groups": record(encode(small("a1", 11))),  # another actor's
            "12.groups": record(b"not a group"),
            "13.groups": record(g13) + record(encode(small("a0", 14)))[:-3]}
    for junk_name, data in junk.items():
        with open(os.path.join(d, junk_name), "wb") as f:
            f.write(data)
    again = Spool(d, "a0")
    assert again.pending() == [(3, encode(chunk[0])), (4, encode(chunk[1])), (13, g13)]
    assert sorted(os.listdir(d)) == sorted([name, "13.groups"])  # 14 was cut short: never sent
    again.settle(4)
    again.settle(13)
    assert os.listdir(d) == [name]  # seq 3 is still unacked
    again.settle(4)  # a second answer to a resend
    again.settle(3)
    assert os.listdir(d) == []


def test_spool_empties_its_file_when_every_group_in_it_is_settled_and_starts_another_when_full(tmp_path,
                                                                                               monkeypatch):
    d = str(tmp_path / "spool")
    sp = Spool(d, "a0")
    sp.put([0, 1], [encode(small("a0", 0)), encode(small("a0", 1))])
    sp.put([2], [encode(small("a0", 2))])
    (name,) = os.listdir(d)
    path = os.path.join(d, name)
    sp.settle(0)
    sp.settle(2)
    assert os.path.getsize(path) == len(record(encode(small("a0", 0)), encode(small("a0", 1)))) + \
        len(record(encode(small("a0", 2))))
    sp.settle(1)
    assert os.listdir(d) == [name] and os.path.getsize(path) == 0  # emptied, written from its start again
    monkeypatch.setattr(Spool, "FILE_BYTES", 1)
    sp.put([3], [encode(small("a0", 3))])
    sp.put([4], [encode(small("a0", 4))])  # the file is full: a new one
    assert len(os.listdir(d)) == 2 and os.path.getsize(path) == len(record(encode(small("a0", 3))))
    assert [s for s, _ in Spool(d, "a0").pending()] == [3, 4]
    sp.settle(3)  # the full file's last group: it goes
    assert len(os.listdir(d)) == 1 and not os.path.exists(path)
    sp.close()


def test_a_spool_write_that_fails_leaves_no_torn_record_behind(tmp_path, monkeypatch):
    d = str(tmp_path / "spool")
    sp = Spool(d, "a0")
    sp.put([0], [encode(small("a0", 0))])
    real = os.pwrite

    def half_then_full_disk(fd, data, at):
        if len(data) > 100:
            return real(fd, data[:100], at)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", half_then_full_disk)
    with pytest.raises(OSError):
        sp.put([1], [encode(small("a0", 1))])
    monkeypatch.setattr(os, "pwrite", real)
    sp.put([2], [encode(small("a0", 2))])  # the disk has room again
    sp.close()
    assert [s for s, _ in Spool(d, "a0").pending()] == [0, 2]  # the failed chunk was never sent
