"""Group commit (``buffer.fsync = batch``): acks and batches wait for the background fsync, the loop
keeps working meanwhile, deletions wait for the snapshot that supersedes them, and a failed fsync
stops the server. ``buffer.persist._fsync`` is replaced by a gate the test opens and closes."""

import os
import threading
import time

import msgspec
import pytest
import zmq

from buffer import persist
from buffer.client import ActorClient
from buffer.persist import SegmentLog
from buffer.server import BufferServer
from buffer.store import SeenKeys
from buffer.synth import make_group
from buffer.testing import RawActor, ServerThread, make_config, reopen_log
from core import net
from core.messages import BUFFER_TO_ACTOR, BUFFER_TO_LEARNER, Ack, Acks, Hello, SampleRequest, decoder, encode


class FsyncGate:
    """Stands in for os.fsync: passes through while open, blocks the caller while closed."""

    def __init__(self):
        self._open = threading.Event()
        self._open.set()
        self.blocked = threading.Event()  # set while some fsync is held at the gate
        self.calls = 0

    def __call__(self, fd):
        self.calls += 1
        if not self._open.is_set():
            self.blocked.set()
            self._open.wait()
        os.fsync(fd)

    def close(self):
        self.blocked.clear()
        self._open.clear()

    def open(self):
        self._open.set()


@pytest.fixture
def gate(monkeypatch):
    g = FsyncGate()
    monkeypatch.setattr(persist, "_fsync", g)
    yield g
    g.open()  # never leave a flusher thread stuck behind the gate


def small(actor, seq):
    return make_group(actor, seq, completions=2, tokens=16)


def dealer(ctx, port):
    s = net.socket(ctx, zmq.DEALER)
    net.connect(s, "127.0.0.1", port)
    return s


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def open_log(d, segment_bytes, seen):
    return reopen_log(d, segment_bytes, seen)[0]


def test_ack_waits_for_the_background_fsync_while_the_next_groups_are_appended(tmp_path, gate):
    cfg = make_config(fsync="batch")
    ctx = zmq.Context()
    acks = decoder(BUFFER_TO_ACTOR)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor = dealer(ctx, cfg.net.buffer_actor_port)
        actor.send(encode(Hello("actor", "a")))
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
    cfg = make_config(fsync="batch")
    ctx = zmq.Context()
    with ServerThread(cfg, str(tmp_path)) as srv:
        learner = dealer(ctx, cfg.net.buffer_learner_port)
        learner.send(encode(Hello("learner", "L")))
        learner.send(encode(SampleRequest(1, 1, 0)))  # held: nothing to serve yet
        actor = dealer(ctx, cfg.net.buffer_actor_port)
        wait_for(lambda: srv._learners and any(st.pending for st in srv._learners.values()))
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


@pytest.mark.parametrize("fsync", ["batch", "never"])
def test_a_failed_write_on_the_io_thread_stops_the_server_loop(tmp_path, monkeypatch, fsync):
    """Records are written by the log's I/O thread: a write error there (a full disk, say) must
    surface in the loop -- never a hung thread, never an ack for a group not in the file."""
    cfg = make_config(fsync=fsync)
    srv = BufferServer(cfg, str(tmp_path))
    try:
        def full(fd, header, payload):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(persist, "_write_all", full)
        actor = RawActor(cfg)
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


def test_a_segment_snapshot_never_remembers_a_group_whose_record_follows_it(tmp_path):
    """A roll writes the SEEN snapshot first; were the group that caused the roll already in it,
    a power loss after the snapshot but before the group's record would leave the key 'seen'
    with no record: the actor's resend would be answered 'duplicate' and the group lost."""
    group = small("a0", 0)
    cfg = make_config(fsync="batch", segment_bytes=3 * len(encode(group)))
    run = str(tmp_path / "run")
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
        records = list(persist.iter_records(open(path, "rb").read()))
        kind, snap = records[0][1], records[0][2]
        assert kind == persist.SEEN
        remembered = SeenKeys()
        remembered.merge(msgspec.msgpack.decode(snap))
        here = [persist._group_key(p) for _, k, p in records if k == persist.GROUP]
        assert here and not [key for key in here if key in remembered], path
