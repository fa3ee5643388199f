"""Crash tests with real processes and SIGKILL: nothing acked is lost, nothing is served twice.

1. The buffer process is SIGKILLed mid-stream (with groups in flight and a batch leased to the
   learner) and restarted on the same run_dir and ports.
2. The actor process is SIGKILLed mid-stream, and again while the buffer is down (so its spool
   certainly holds unacked groups), and restarted each time: the next incarnation resends them.
"""

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from buffer.client import WINDOW, ActorClient, LearnerClient, Spool, spool_path
from core import config as C
from tests.support.buffer import ROOT, ServerProcess, ServerThread, make_config, wait_for
from tests.support.synth import make_group


def small(seq, group_id):
    return make_group("a0", seq, completions=2, tokens=16, group_id=group_id)


class Drain:
    """The learner side: every group returned by sample(), in order."""

    def __init__(self, cfg):
        self.client = LearnerClient(cfg, resend_s=0.5)
        self.groups = []

    def take(self, n, consume=True):
        b = self.client.sample(n, 0, timeout_s=30)
        assert b is not None, "buffer stopped serving"
        self.groups += b.groups
        if consume:
            self.client.consumed([g.key for g in b.groups], 0)
        return b

    def until(self, keys: set):
        while not keys <= {g.key for g in self.groups}:
            self.take(1)

    def check_exactly_once(self, group_ids: dict):
        keys = [g.key for g in self.groups]
        assert len(keys) == len(set(keys)), "a group was served twice"
        for g in self.groups:  # and it is the group that was sent under that key
            assert g.group_id == group_ids[g.key]
        assert self.client.sample(1, 0, timeout_s=0.5) is None, "something left over"


def test_buffer_sigkill_mid_stream(tmp_path):
    run = str(tmp_path / "run")
    cfg = make_config(run_dir=run, fsync="batch")
    srv = ServerProcess(cfg, run)
    acked = set()
    group_ids = {}
    actor = ActorClient(cfg, "a0", resend_s=0.5, run_dir=run,
                        on_ack=lambda a: a.status in ("ok", "duplicate") and acked.add((a.actor_id, a.seq)))
    learner = Drain(cfg)

    def send(n):
        for _ in range(n):
            seq = actor.next_seq()
            group_ids[("a0", seq)] = f"g{seq}"
            actor.send(small(seq, f"g{seq}"))

    try:
        send(40)
        assert actor.flush(10)
        learner.take(8)
        learner.take(8)
        held = learner.take(4, consume=False)  # leased when the buffer dies
        send(20)  # no flush: some of these are in flight
        acked_before_kill = set(acked)
        srv.kill(signal.SIGKILL)
        srv = ServerProcess(cfg, run)
        learner.client.consumed([g.key for g in held.groups], 0)  # the learner finishes its step
        send(40)
        assert actor.flush(30)
        assert set(group_ids) == acked  # every group was eventually acked
        learner.until(set(group_ids))
        learner.check_exactly_once(group_ids)
        assert acked_before_kill <= {g.key for g in learner.groups}
        log = srv.stop()
        assert srv.proc.returncode == 0 and "buffer stopped" in log
        assert "invariant broken" not in log
    finally:
        srv.kill()
        actor.close()
        learner.client.close()
    with ServerThread(cfg, run) as replayed:  # what is on disk agrees: all consumed, all seen
        assert not replayed.store.resident
        assert all(k in replayed.store.seen for k in group_ids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_process_stops_cleanly_on_signal(tmp_path, sig):
    cfg = make_config(run_dir=tmp_path)
    srv = ServerProcess(cfg, str(tmp_path))
    try:
        srv.kill(sig)
        assert srv.proc.returncode == 0
        assert "buffer stopped" in srv.proc.stderr.read()
    finally:
        srv.kill()


ACTOR_SCRIPT = r"""
import sys
from core import config as C
from buffer.client import ActorClient
from tests.support.synth import make_group

cfg_path, incarnation, count, log_path, run_dir = sys.argv[1:6]
with open(cfg_path, "rb") as f:
    cfg = C.from_json(f.read())
log = open(log_path, "a", buffering=1)  # line-buffered: a SIGKILL loses no written line


def on_ack(a):
    if a.status in ("ok", "duplicate"):
        log.write(f"ack {a.seq}\n")


client = ActorClient(cfg, "a0", run_dir=run_dir, on_ack=on_ack, resend_s=0.5)
log.write(f"start {incarnation} {client.outstanding}\n")
n, i = int(count), 0
while n < 0 or i < n:
    seq = client.next_seq()
    gid = f"inc{incarnation}-{seq}"
    log.write(f"intent {seq} {gid}\n")
    client.send(make_group("a0", seq, completions=2, tokens=16, group_id=gid))
    log.write(f"sent {seq} {gid}\n")
    i += 1
    client.poll(5)
log.write(f"flushed {client.flush(30)}\n")
client.close()
"""


class ActorLog:
    def __init__(self, path):
        self.path = path

    def lines(self, kind):
        with open(self.path) as f:
            return [ln.split()[1:] for ln in f if ln.startswith(kind + " ")]

    def count(self, kind):
        return len(self.lines(kind))


def start_actor(tmp_path, cfg_path, incarnation, count, log, run_dir):
    script = tmp_path / "actor.py"
    script.write_text(ACTOR_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(script), cfg_path, str(incarnation), str(count), log.path,
                             run_dir], env=env, cwd=ROOT)


def spooled_seqs(run):
    """Seqs the actor's spool holds, read without touching it. A record still being written (or cut short by
    a kill) fails to decode and is left out, as ``Spool.pending`` discards it: its groups were never sent."""
    d, seqs = spool_path(run, "a0"), []
    for name in os.listdir(d) if os.path.isdir(d) else []:
        with contextlib.suppress(FileNotFoundError):
            seqs += [seq for seq, _ in Spool(d, "a0")._read(name) or []]
    return sorted(seqs)


def test_actor_sigkill_and_restart_from_its_spool(tmp_path):
    run = str(tmp_path / "run")
    cfg = make_config(run_dir=run, fsync="batch")
    cfg_path = os.path.join(run, "config.json")
    with open(cfg_path, "wb") as f:
        f.write(C.to_json(cfg))
    log = ActorLog(str(tmp_path / "actor.log"))
    open(log.path, "w").close()
    procs = []
    server = ServerThread(cfg, run)
    try:
        server.__enter__()
        # 1. killed mid-stream, buffer up
        procs.append(start_actor(tmp_path, cfg_path, 1, -1, log, run))
        wait_for(lambda: log.count("ack") >= 25, timeout=30)
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait(10)
        # 2. restarted, streaming; killed while the buffer is down, so its window is unacked
        procs.append(start_actor(tmp_path, cfg_path, 2, -1, log, run))
        wait_for(lambda: log.count("ack") >= 45, timeout=30)
        server.stop()
        accepted = server.server.store.seen  # the buffer's truth: an ack may be settled, then killed unlogged
        # no acks any more: the actor fills its window of unacked groups and blocks in send()
        wait_for(lambda: len(spooled_seqs(run)) >= WINDOW, timeout=30)
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait(10)
        spooled = spooled_seqs(run)
        acked_before = {int(s) for (s,) in log.lines("ack")}
        unacked = {s for s in {int(s) for s, _ in log.lines("sent")} - acked_before if ("a0", s) not in accepted}
        assert unacked and unacked <= set(spooled)  # every group sent and not accepted is in the spool
        # 3. buffer back; the actor's next life resends its spool, sends 10 more and exits cleanly
        server = ServerThread(cfg, run)
        srv = server.__enter__()
        procs.append(start_actor(tmp_path, cfg_path, 3, 10, log, run))
        assert procs[-1].wait(60) == 0
        assert log.lines("flushed")[-1] == ["True"]
        assert [ln for ln in log.lines("start")][-1] == ["3", str(len(spooled))]

        # a seq comes back only when its group never reached the spool (killed before it was
        # sent): then the buffer never saw it either, and the later group owns the seq
        group_ids = {("a0", int(s)): gid for s, gid in log.lines("intent")}  # the last intent per seq
        sent = {("a0", int(s)): gid for s, gid in log.lines("sent")}
        assert all(group_ids[k] == gid for k, gid in sent.items()), "a seq was reused after its group was sent"
        acked = {("a0", int(s)) for (s,) in log.lines("ack")}
        learner = Drain(cfg)
        learner.until(set(sent) | acked)
        learner.check_exactly_once(group_ids)
        assert srv.store.invariant_ok() and not srv.store.resident
        learner.client.close()
    finally:
        server.stop()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(10)
