"""Group commit (``buffer.fsync = batch``) in the running server: acks and batches wait for the
background fsync while the loop keeps working, a failed write on the I/O thread stops the loop,
and no segment's snapshot remembers a group whose record follows it. ``buffer.persist._fsync``
is replaced by a gate the test opens and closes."""

import os
import time

import msgspec
import pytest
import zmq

from buffer import persist
from buffer.client import ActorClient
from buffer.server import BufferServer
from buffer.store import SeenKeys
from core import net
from core.messages import (BUFFER_TO_ACTOR, BUFFER_TO_LEARNER, Ack, Acks, Hello, SampleRequest, decoder, encode,
                           group_key)
from tests.support.buffer import RawActor, ServerThread, gate, make_config, token, wait_for  # noqa: F401 -- gate
from tests.support.synth import make_group


def small(actor, seq):
    return make_group(actor, seq, completions=2, tokens=16)


def dealer(ctx, port):
    s = net.socket(ctx, zmq.DEALER)
    net.connect(s, "127.0.0.1", port)
    return s


def test_ack_waits_for_the_background_fsync_while_the_next_groups_are_appended(tmp_path, gate):
    cfg = make_config(run_dir=tmp_path, fsync="batch")
    ctx = zmq.Context()
    acks = decoder(BUFFER_TO_ACTOR)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor = dealer(ctx, cfg.net.buffer_actor_port)
        actor.send(encode(Hello("actor", "a", token=token(cfg))))
        assert actor.poll(5000) and acks.decode(actor.recv()) == Ack("a", 0, "hello")
        gate.close()
        actor.send(encode(small("a", 0)))
        assert gate.blocked.wait(5), "the group's record was never handed to fsync"
        written = srv.log.written
        actor.send(encode(small("a", 1)))  # arrives while the disk is still syncing seq 0
        deadline = time.monotonic() + 5
        while srv.log.written == written:
            assert time.monotonic() < deadline, "the loop stopped appending during the fsync"
            time.sleep(0.01)
        assert srv.store.available() == 2
        assert not actor.poll(300), "an ack left before its record was durable"
        gate.open()
        got = []
        while len(got) < 2:
            assert actor.poll(5000), "no ack after the fsync finished"
            msg = acks.decode(actor.recv())
            got += msg.acks if isinstance(msg, Acks) else [msg]
        assert [(a.seq, a.status) for a in got] == [(0, "ok"), (1, "ok")]
        assert srv.log.durable == srv.log.written
        actor.close()
    ctx.term()


def test_a_batch_of_groups_not_yet_durable_waits_for_the_fsync(tmp_path, gate):
    cfg = make_config(run_dir=tmp_path, fsync="batch")
    ctx = zmq.Context()
    with ServerThread(cfg, str(tmp_path)) as srv:
        learner = dealer(ctx, cfg.net.buffer_learner_port)
        learner.send(encode(Hello("learner", "L", token=token(cfg))))
        learner.send(encode(SampleRequest(1, 1, 0)))  # held: nothing to serve yet
        actor = dealer(ctx, cfg.net.buffer_actor_port)
        actor.send(encode(Hello("actor", "a", token=token(cfg))))
        wait_for(lambda: srv._learner is not None and srv._learner.pending is not None)
        gate.close()
        g = small("a", 0)
        actor.send(encode(g))
        assert gate.blocked.wait(5)
        wait_for(lambda: srv.store.leased == 1)  # cut from the group at once ...
        assert not learner.poll(300), "a batch left before its group was durable"  # ... sent later
        gate.open()
        assert learner.poll(5000)
        frames = learner.recv_multipart()
        assert decoder(BUFFER_TO_LEARNER).decode(frames[0]).request_id == 1
        assert frames[1] == encode(g)  # the actor's bytes, forwarded as they came
        actor.close()
        learner.close()
    ctx.term()


@pytest.mark.parametrize("fsync", ["batch", "never"])
def test_a_failed_write_on_the_io_thread_stops_the_server_loop(tmp_path, monkeypatch, fsync):
    """Records are written by the log's I/O thread: a write error there (a full disk, say) must
    surface in the loop -- never a hung thread, never an ack for a group not in the file."""
    cfg = make_config(run_dir=tmp_path, fsync=fsync)
    srv = BufferServer(cfg, str(tmp_path))
    try:
        def full(fd, bufs):
            raise OSError(28, "No space left on device")

        actor = RawActor(cfg)
        actor.send(Hello("actor", "a", token=token(cfg)))
        wait_for(lambda: srv.step(10) or actor.sock.poll(0))
        assert actor.recv().status == "hello"
        monkeypatch.setattr(persist, "_write_all", full)
        actor.send(small("a", 0))
        with pytest.raises(OSError, match="No space left"):
            for _ in range(200):
                srv.step(10)
        assert srv.log.durable < srv.log.written
        assert not actor.sock.poll(100), "an ack left for a group whose record was never written"
        actor.close()
    finally:
        monkeypatch.undo()
        srv.close()


def test_a_segment_snapshot_never_remembers_a_group_whose_record_follows_it(tmp_path):
    """A roll writes the SEEN snapshot first; were the group that caused the roll already in it,
    a power loss after the snapshot but before the group's record would leave the key 'seen'
    with no record: the actor's resend would be answered 'duplicate' and the group lost."""
    group = small("a0", 0)
    run = str(tmp_path / "run")
    cfg = make_config(run_dir=run, fsync="batch", segment_bytes=3 * len(encode(group)))
    with ServerThread(cfg, run):
        actor = ActorClient(cfg, "a0")
        for _ in range(12):
            actor.send(small("a0", actor.next_seq()))
        assert actor.flush(10)
        actor.close()
    seg_dir = os.path.join(run, "buffer")
    paths = sorted(os.path.join(seg_dir, n) for n in os.listdir(seg_dir) if n.endswith(".log"))
    assert len(paths) >= 3
    for path in paths:
        records = persist.scan(open(path, "rb").read())[0]
        kind, snap = records[0][1], records[0][2]
        assert kind in persist.SEEN_KINDS
        remembered = SeenKeys()
        remembered.merge(msgspec.msgpack.decode(snap))
        here = [group_key(p) for _, k, p in records if k == persist.GROUP]
        assert here and not [key for key in here if key in remembered], path
