"""Well-formed messages with hostile meaning, against a real server: groups that would break the
learner, peers that are not the run's, a learner that vanishes. Each is refused or undone,
counted under its reason, and nothing a peer sends costs an accepted group or trains one twice."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from buffer.client import ActorClient, BufferUnavailable, LearnerClient, Spool, Stopped, spool_path
from buffer.server import MAX_VERSION_LEAD
from core import config as C
from core import net
from core.messages import (BUFFER_TO_LEARNER, Ack, Consumed, Hello, RolloutGroup, SampleRequest, decoder, encode,
                           make_completion)
from tests.support.buffer import (ROOT, VOCAB, RawActor, ServerProcess, ServerThread, make_config, token,
                                  wait_for)
from tests.support.synth import make_group


GROUP = decoder(RolloutGroup)


def small(actor, seq, version=0, **kw):
    return make_group(actor, seq, completions=2, tokens=16, version=version, **kw)


def flat(actor, seq, version):
    """A group every token of which is of ``version``."""
    g = small(actor, seq)
    comps = [msgspec.structs.replace(c, versions=np.full(c.num_tokens, version, "<i4").tobytes())
             for c in g.completions]
    return msgspec.structs.replace(g, completions=comps, start_version=version)


def with_completion(g, i=0, **kw):
    comps = list(g.completions)
    comps[i] = make_completion(**{**dict(tokens=comps[i].token_array(), logprobs=comps[i].logprob_array(),
                                         versions=comps[i].version_array(), finish_reason="stop",
                                         reward=comps[i].reward), **kw})
    return msgspec.structs.replace(g, completions=comps)


def stocked(cfg, n: int) -> RawActor:
    """An authenticated raw actor whose groups 0..n-1 the buffer has accepted."""
    raw = RawActor(cfg, "a0")
    for i in range(n):
        raw.send(small("a0", i))
        assert raw.recv().status == "ok"
    return raw


class RawLearner:
    """A bare learner DEALER: what it sends, and every answer."""

    def __init__(self, cfg, name="L", tok: str | None = None):
        self.ctx = zmq.Context()
        self.sock = net.socket(self.ctx, zmq.DEALER)
        net.connect(self.sock, cfg.net.host, cfg.net.buffer_learner_port)
        self.dec = decoder(BUFFER_TO_LEARNER)
        if tok is not None:
            self.send(Hello("learner", name, token=tok))

    def send(self, msg):
        self.sock.send(encode(msg))

    def recv(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "no answer from the buffer"
        frames = self.sock.recv_multipart()
        return self.dec.decode(frames[0]), frames[1:]

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


# ---- 1. semantic admission -----------------------------------------------------------------------


def test_groups_that_would_break_the_learner_are_refused_with_their_reason(tmp_path):
    cfg = make_config(run_dir=tmp_path, actor=dict(max_new_tokens=16), max_prompt_tokens=32)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, context=40))
    g = small("a0", 0, ragged=False, prompt_tokens=8)
    cases = {
        "token_out_of_vocab": with_completion(g, 1, tokens=np.full(16, VOCAB)),
        "group_size": msgspec.structs.replace(g, completions=g.completions[:1]),
        "empty_prompt": msgspec.structs.replace(g, prompt_tokens=b""),
        "over_limit": with_completion(g, 0, tokens=np.ones(17), logprobs=-np.ones(17), versions=np.zeros(17)),
        "nonfinite_reward": with_completion(g, 0, reward=float("inf")),
        # meanings that decode and are finite in float64, but not in what the learner makes of them
        "reward_out_of_range": with_completion(g, 0, reward=1e39),  # inf as float32
        "logprob_out_of_range": with_completion(g, 1, logprobs=np.full(16, -3e38)),
        "over_context": msgspec.structs.replace(g, prompt_tokens=np.ones(30, "<i4").tobytes()),  # 30 + 16 > 40
        "bad_timestamp": msgspec.structs.replace(g, created_at=float("nan")),
    }
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = RawActor(cfg, "a0")
        for seq, (reason, bad) in enumerate(cases.items()):
            raw.send(msgspec.structs.replace(bad, seq=seq))
            assert raw.recv() == Ack("a0", seq, "rejected", reason)
        too_many = msgspec.structs.replace(g, seq=10, completions=list(g.completions) * 2)
        long_prompt = msgspec.structs.replace(g, seq=11, prompt_tokens=np.ones(33, "<i4").tobytes())
        long_text = msgspec.structs.replace(g, seq=13, tier="x" * 1_000_000)  # a megabyte of string
        for bad in (too_many, long_prompt, long_text):  # refused by the bounded decoder, before allocation
            raw.send(bad)
            assert raw.recv() == Ack("a0", bad.seq, "rejected", "over_limit")
        raw.send(msgspec.structs.replace(g, seq=12))
        assert raw.recv() == Ack("a0", 12, "ok")
        stats = srv.stats()
        assert srv.store.counters.accepted == 1
        for reason in cases:
            assert stats[f"buffer/dropped_invalid/{reason}"] == (4 if reason == "over_limit" else 1)
        raw.close()


def test_two_million_empty_completions_are_refused_at_decode_without_the_memory(tmp_path):
    """The 40 MB frame that took the buffer process to 2.45 GB: refused at the array header, so
    its peak memory grows by about the frame itself (ZeroMQ's copy), not by 2M objects."""
    cfg = make_config(run_dir=tmp_path)
    srv = ServerProcess(cfg, str(tmp_path))
    try:
        def peak_kb():
            with open(f"/proc/{srv.pid}/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM"))

        raw = RawActor(cfg, "a0")
        before = peak_kb()
        empty = make_completion([], [], [], "stop", 0.0)
        frame = encode(msgspec.structs.replace(small("a0", 0), completions=[empty] * 2_000_000))
        raw.send(frame)
        assert raw.recv(30_000) == Ack("a0", 0, "rejected", "over_limit")
        grew = peak_kb() - before
        assert grew < 3 * len(frame) // 1024, f"peak memory grew by {grew} kB for a {len(frame) >> 10} kB frame"
        raw.send(small("a0", 1))
        assert raw.recv() == Ack("a0", 1, "ok")  # and the server is fine
        raw.close()
    finally:
        srv.stop()


def test_versions_newer_than_the_learner_are_held_then_refused(tmp_path):
    """Before the learner has said its version, a group above version 1 is answered busy (kept,
    resent); once it has said v, up to v + 1 is accepted and newer is refused."""
    cfg = make_config(run_dir=tmp_path, max_staleness=100)
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = RawActor(cfg, "a0")
        raw.send(flat("a0", 0, 1))
        assert raw.recv().status == "ok"  # version 0 is assumed: v + 1 = 1 is fine
        raw.send(flat("a0", 1, 5))
        assert raw.recv() == Ack("a0", 1, "busy", "version_unknown")
        learner = RawLearner(cfg, tok=token(cfg))
        learner.send(SampleRequest(1, 50, 3))  # says v = 3, held (not enough groups)
        wait_for(lambda: srv.learner_version == 3)
        raw.send(flat("a0", 1, 5))  # the actor's resend
        assert raw.recv() == Ack("a0", 1, "rejected", "future_version")
        raw.send(flat("a0", 2, 4))
        assert raw.recv().status == "ok"
        assert srv.stats()["buffer/deferred_future"] == 1 and srv.invalid["future_version"] == 1
        raw.close()
        learner.close()


def test_the_actor_client_resends_a_group_held_until_the_learner_reports(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor = ActorClient(cfg, "a0")
        actor.send(flat("a0", actor.next_seq(), 7))  # e.g. a buffer restarted mid-run
        assert not actor.flush(0.3) and srv.deferred >= 1
        flushed = []
        t = threading.Thread(target=lambda: flushed.append(actor.flush(20)))  # it resends meanwhile
        t.start()
        learner = LearnerClient(cfg)
        assert learner.sample(1, 7, timeout_s=20).groups[0].key == ("a0", 0)
        t.join(30)
        assert flushed == [True] and not actor.poll(0)  # accepted, never refused
        actor.close()
        learner.close()


# ---- 2. peers that are not the run's ------------------------------------------------------------


def test_a_stranger_without_the_secret_gets_nothing_through(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        for _ in range(3):
            actor.send(small("a0", actor.next_seq()))
        assert actor.flush(10)
        held = learner.sample(2, 0, timeout_s=10)  # leased to the real learner
        stranger = RawActor(cfg)
        stranger.send(Hello("actor", "a0", token="0" * 64))
        assert stranger.recv() == Ack("a0", -1, "rejected", "bad_token")
        stranger.send(small("a0", 99))  # injected under the real actor's id
        assert stranger.recv() == Ack("a0", 99, "unauthenticated")
        thief = RawLearner(cfg, tok="")
        assert thief.recv()[0] == Ack("", -1, "rejected", "bad_token")
        thief.send(SampleRequest(1, 1, 10**9))  # an absurd version: would make everything stale
        thief.send(Consumed([g.key for g in held.groups] + [("a0", 2)], 10**9))  # retire untrained groups
        assert thief.recv()[0].status == "unauthenticated"
        wait_for(lambda: srv.invalid["unauthenticated"] >= 3)
        assert srv.learner_version == 0 and srv.store.leased == 2 and len(srv.store.resident) == 3
        assert ("a0", 99) not in srv.store.seen
        learner.consumed([g.key for g in held.groups], 1)
        actor.send(small("a0", actor.next_seq()))  # still fresh: the stranger's version never counted
        assert actor.flush(10) and not actor.poll(0)
        assert [g.key for g in learner.sample(2, 1, timeout_s=10).groups] == [("a0", 2), ("a0", 3)]
        for c in (stranger, thief, actor, learner):
            c.close()


def test_an_actor_id_belongs_to_the_connection_that_said_hello_with_it(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        a0, a1 = RawActor(cfg, "a0"), RawActor(cfg, "a1")
        a1.send(small("a0", 0))  # a real actor of the run, but not a0
        assert a1.recv() == Ack("a0", 0, "rejected", "wrong_peer")
        a0.send(small("a0", 0))
        assert a0.recv().status == "ok"
        again = RawActor(cfg, "a0")  # a restarted a0 takes its id over
        again.send(small("a0", 1))
        assert again.recv().status == "ok"
        a0.send(small("a0", 2))  # the old connection of a0 no longer speaks for it
        assert a0.recv() == Ack("a0", 2, "unauthenticated")
        assert srv.invalid["wrong_peer"] == 1 and sorted(srv.store.resident) == [("a0", 0), ("a0", 1)]
        for c in (a0, a1, again):
            c.close()


def test_one_learner_at_a_time_and_consumed_only_what_it_holds(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = stocked(cfg, 4)
        first = RawLearner(cfg, "L", tok=token(cfg))
        first.send(SampleRequest(1, 2, 0))
        assert [GROUP.decode(f).key for f in first.recv()[1]] == [("a0", 0), ("a0", 1)]
        first.send(Consumed([("a0", 0), ("a0", 3)], 1))  # ("a0", 3) was never served to it
        wait_for(lambda: srv.store.counters.consumed == 1)
        assert srv.store.counters.consumed_not_leased == 1 and ("a0", 3) in srv.store.resident
        first.send(SampleRequest(2, 1, 0))  # a version going down within one incarnation
        wait_for(lambda: srv.invalid["version_regressed"] == 1)
        second = RawLearner(cfg, "L", tok=token(cfg))  # the learner restarted: ("a0", 1) comes back
        wait_for(lambda: srv.store.leased == 0)
        second.send(SampleRequest(1, 3, 0))  # a new incarnation may start anywhere, even lower
        keys = [GROUP.decode(f).key for f in second.recv()[1]]
        assert keys == [("a0", 1), ("a0", 2), ("a0", 3)]
        first.send(Consumed(keys, 5))  # the replaced learner is nobody now
        assert first.recv()[0].status == "unauthenticated"
        assert srv.store.leased == 3 and srv.store.counters.consumed == 1 and srv.store.invariant_ok()
        for c in (raw, first, second):
            c.close()


LEARNER_SCRIPT = r"""
import sys, time
from core import config as C
from buffer.client import LearnerClient
cfg = C.from_json(open(sys.argv[1], "rb").read())
client = LearnerClient(cfg)
batch = client.sample(3, 0, timeout_s=30)
print(len(batch.groups), flush=True)
time.sleep(600)  # holds its leases until killed
"""


def test_a_learner_that_dies_gives_its_leases_back_at_once(tmp_path):
    """SIGKILL, no goodbye, no new learner: the socket monitor sees the connection close and the
    leased groups are available again (they were never trained on)."""
    run = str(tmp_path / "run")
    cfg = make_config(run_dir=run)
    with ServerThread(cfg, run) as srv:
        raw = stocked(cfg, 3)
        path = os.path.join(run, "config.json")
        with open(path, "wb") as f:
            f.write(C.to_json(cfg))
        proc = subprocess.Popen([sys.executable, "-c", LEARNER_SCRIPT, path], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        try:
            assert proc.stdout.readline().strip() == "3"
            assert srv.store.leased == 3
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            wait_for(lambda: srv.store.leased == 0)
            assert srv.stats()["buffer/leases_expired"] == 3 and srv.store.available() == 3
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        learner = LearnerClient(cfg)
        assert len(learner.sample(3, 0, timeout_s=10).groups) == 3
        learner.close()
        raw.close()


def test_clients_say_hello_again_to_a_restarted_buffer(tmp_path):
    """A new buffer process knows no connection: both clients are told "unauthenticated", say
    Hello with the secret again and carry on, losing nothing."""
    run = str(tmp_path / "run")
    cfg = make_config(run_dir=run, fsync="always")
    srv = ServerProcess(cfg, run)
    actor, learner = ActorClient(cfg, "a0", resend_s=0.5), LearnerClient(cfg, resend_s=0.5)
    try:
        actor.send(small("a0", actor.next_seq()))
        assert actor.flush(10)
        srv.stop()
        srv = ServerProcess(cfg, run)
        actor.send(small("a0", actor.next_seq()))
        assert actor.flush(20) and not actor.poll(0)
        keys = []
        while len(keys) < 2:
            b = learner.sample(2 - len(keys), 0, timeout_s=20)
            keys += [g.key for g in b.groups]
        assert keys == [("a0", 0), ("a0", 1)]
    finally:
        actor.close()
        learner.close()
        log = srv.stop()
    assert "unauthenticated" not in log  # (never an error, only counted)


def test_a_wrong_secret_is_a_clear_error_for_both_clients(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    with ServerThread(cfg, str(tmp_path)):
        actor = ActorClient(cfg, "a0", token="f" * 64)
        with pytest.raises(RuntimeError, match="bad_token"):
            actor.next_seq()
        learner = LearnerClient(cfg, token="f" * 64)
        with pytest.raises(RuntimeError, match="bad_token"):
            learner.sample(1, 0, timeout_s=5)
        actor.close()
        learner.close()


def test_without_a_secret_file_a_loopback_buffer_accepts_any_hello(tmp_path):
    cfg = make_config()  # no run dir, no secret: a tool or test without a launcher
    srv = ServerThread(msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, run_dir=str(tmp_path))),
                       str(tmp_path))
    with srv as server:
        assert server.token is None
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        actor.send(small("a0", actor.next_seq()))
        assert learner.sample(1, 0, timeout_s=10).groups[0].key == ("a0", 0)
        actor.close()
        learner.close()


# ---- the clients' waits: a deadline and the stop flag ----------------------------------------------


class MuteBuffer:
    """Answers the actor's Hello, then never acks anything."""

    def __init__(self, cfg):
        self.ctx = zmq.Context()
        self.sock = net.socket(self.ctx, zmq.ROUTER)
        net.bind(self.sock, "127.0.0.1", cfg.net.buffer_actor_port)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        dec = decoder(Hello)
        while not self.stop.is_set():
            if self.sock.poll(20):
                ident, frame = self.sock.recv_multipart()
                try:
                    hello = dec.decode(frame)
                except msgspec.ValidationError:
                    continue
                self.sock.send_multipart([ident, encode(Ack(hello.id, 0, "hello"))])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def test_a_blocked_send_returns_when_stopped_and_leaves_the_rest_in_the_spool(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    buf, stop = MuteBuffer(cfg), threading.Event()
    actor = ActorClient(cfg, "a0", run_dir=str(tmp_path), window=1, stop=stop)
    try:
        groups = [small("a0", actor.next_seq()) for _ in range(3)]
        done = threading.Event()
        t = threading.Thread(target=lambda: (actor.send_many(groups), done.set()))
        t.start()
        assert not done.wait(0.5)  # the window is full: send blocks
        stop.set()
        t.join(10)
        assert done.is_set(), "send_many ignored the stop flag"
        spooled = Spool(spool_path(str(tmp_path), "a0"), "a0").pending()
        assert [s for s, _ in spooled] == [0, 1, 2]  # seq 0 sent; 1 and 2 spooled, for the next life
        assert not actor.flush(5)  # returns at once: stopped
    finally:
        actor.close()
        buf.close()


def test_waits_without_a_deadline_give_up_on_a_silent_buffer(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    nobody = ActorClient(cfg, "a0", timeout_s=0.3)  # nothing listens on the port
    with pytest.raises(BufferUnavailable):
        nobody.next_seq()
    nobody.close()
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        ActorClient(cfg, "a1", stop=stop).next_seq()
    buf = MuteBuffer(cfg)
    actor = ActorClient(cfg, "a2", window=1, timeout_s=0.5)
    try:
        actor.send(small("a2", actor.next_seq()))
        with pytest.raises(BufferUnavailable, match="1 groups unacked"):
            actor.send(small("a2", actor.next_seq()))
    finally:
        actor.close()
        buf.close()
    t_stop = time.monotonic() + 0.3
    learner = LearnerClient(cfg, stop=lambda: time.monotonic() > t_stop)  # a callable works too
    assert learner.sample(1, 0, timeout_s=None) is None  # no deadline, but stopped
    learner.close()


def test_raw_tcp_garbage_zmtp1_frames_and_half_greetings_leave_the_buffer_serving(tmp_path):
    """Anything a TCP peer can send, at both ports of a real buffer process, without a secret: nine
    bytes of ZMTP/1.0 once stopped the buffer (a ZeroMQ error reading the frame's source). The same
    process serves on, and a legacy peer's frames are counted, never taken."""
    import random
    import socket
    run = str(tmp_path)
    cfg = make_config(run_dir=run)
    srv = ServerProcess(cfg, run)
    rng = random.Random(0)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL"  # a ZMTP/3 greeting cut off halfway
    payloads = [bytes.fromhex("01000600") + b"hello", bytes.fromhex("0100"), greeting,
                bytes.fromhex("ff0000000000000001") + os.urandom(32)]
    try:
        pid = srv.proc.pid
        for port in (cfg.net.buffer_actor_port, cfg.net.buffer_learner_port):
            for i in range(120):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(payloads[i % 4] if i % 5 else bytes(rng.randbytes(rng.randint(1, 300))))
                    if i % 10 == 0:
                        time.sleep(0.01)  # some linger long enough for ZeroMQ to read them
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        groups = [small("a0", actor.next_seq()) for _ in range(6)]
        actor.send_many(groups)
        assert actor.flush(20)
        got = learner.sample(6, 0, timeout_s=20)
        assert got is not None and sorted(g.key for g in got.groups) == [g.key for g in groups]
        assert srv.proc.poll() is None and srv.proc.pid == pid  # the same process, still serving
        actor.close()
        learner.close()
    finally:
        log = srv.stop()
    assert "Traceback" not in log and re.search(r"invalid [1-9]", log), log[-2000:]  # refused and counted


def test_a_learners_claimed_version_is_bounded_and_does_not_outlive_it(tmp_path):
    """A version no token can carry is refused; one far above what the buffer has seen is believed
    only MAX_VERSION_LEAD above it; a departed learner leaves behind only the version its Hello and
    its trained steps showed (a claim of 2**30 once made every resident and new group stale)."""
    cfg = make_config(run_dir=tmp_path, max_staleness=2)
    with ServerThread(cfg, str(tmp_path)) as srv:
        raw = stocked(cfg, 3)
        first = RawLearner(cfg, "L", tok=token(cfg))
        first.send(SampleRequest(1, 1, 0))
        keys = [GROUP.decode(f).key for f in first.recv()[1]]
        first.send(Consumed(keys, 1, step=1))  # trained at step 1, now version 1
        first.send(SampleRequest(2, 5, 2**62))
        wait_for(lambda: srv.invalid["version_out_of_range"] == 1)
        first.send(SampleRequest(3, 5, 2**30))  # believed only a small step above the record
        wait_for(lambda: srv.invalid["version_ahead"] == 1)
        assert srv.learner_version == 1 + MAX_VERSION_LEAD
        first.close()
        wait_for(lambda: srv.learner_version == 1)  # gone: only what its trained step showed
        raw.send(small("a0", 3))
        assert raw.recv() == Ack("a0", 3, "ok")  # not stale against 2**30
        liar = RawLearner(cfg, "L2")
        liar.send(Hello("learner", "L2", token=token(cfg), step=0, version=2**40))
        assert liar.recv()[0] == Ack("", -1, "rejected", "bad_hello")
        assert len(srv.store.resident) == 3 and srv.store.counters.rejected["stale"] == 0
        for c in (raw, liar):
            c.close()
    with ServerThread(cfg, str(tmp_path)) as srv:  # restarted: the record survives in its store
        late = RawLearner(cfg, "L3", tok=token(cfg))
        late.send(SampleRequest(1, 1, 2**20))
        wait_for(lambda: srv.invalid["version_ahead"] == 1)
        assert srv.learner_version == 1 + MAX_VERSION_LEAD
        late.close()
