"""The buffer's one durable copy (buffer/durable.py): acks only after the commit, trained groups
kept until a checkpoint covers them and served again to a learner restarted from an older step,
and a damaged store refused by name."""

import os
import sqlite3
import subprocess
import sys
import time

import pytest

from buffer import durable
from buffer.client import ActorClient, LearnerClient
from core.messages import encode
from tests.support.buffer import ROOT, RawActor, ServerProcess, ServerThread, make_config, wait_for
from tests.support.synth import make_group


def small(seq, version=0):
    return make_group("a0", seq, completions=2, tokens=16, version=version)


def _rows(run, where="1"):
    db = sqlite3.connect(os.path.join(run, "buffer", durable.FILE))  # a second reader, as after a crash
    try:
        return db.execute(f"SELECT actor, seq, state, step FROM groups WHERE {where} ORDER BY seq").fetchall()
    finally:
        db.close()


def _take(learner, n, step):
    b = learner.sample(n, max(step, 0), timeout_s=10)
    assert b is not None and len(b.groups) == n
    learner.consumed([g.key for g in b.groups], max(step, 0), step)
    return [g.key for g in b.groups]


def test_an_ok_ack_leaves_only_after_its_group_is_committed(tmp_path):
    run = str(tmp_path)
    cfg = make_config(run_dir=run)
    with ServerThread(cfg, run):
        actor = RawActor(cfg, "a0")
        for seq in range(5):
            actor.send(small(seq))
            ack = actor.recv()
            assert ack.status == "ok"
            assert ("a0", seq, durable.RESIDENT, None) in _rows(run)  # visible to another connection
        actor.close()


def test_trained_groups_are_kept_until_covered_and_served_again_after_a_learner_restart(tmp_path):
    run = str(tmp_path)
    cfg = make_config(run_dir=run)
    with ServerThread(cfg, run) as srv:
        actor = ActorClient(cfg, "a0")
        actor.send_many([small(actor.next_seq()) for _ in range(4)])
        assert actor.flush(10)
        first = LearnerClient(cfg, step=0, version=0)
        _take(first, 2, 1)
        step2 = [g.key for g in first.sample(2, 2, timeout_s=10).groups]  # the buffer hears of version 2 ...
        actor.send(small(actor.next_seq(), version=2))  # ... so a group of version 2 (or 3) may come
        assert actor.flush(10)
        step2 += [g.key for g in first.sample(1, 2, timeout_s=10).groups]
        first.consumed(step2, 2, 2)
        first.sample(1, 2, timeout_s=0.3, covered_step=1)  # a checkpoint's predecessor holds step 1
        wait_for(lambda: [r[2] for r in _rows(run, "seq < 5")] == [durable.DONE] * 2 + [durable.TRAINED] * 3)
        first.close()
        # a learner restarted from the checkpoint of step 1, version 1: step 2's groups are served
        # again, but (a0, 4), every token of version >= 2 > 1, was sampled by weights that no longer exist
        again = LearnerClient(cfg, step=1, version=1)
        b = again.sample(2, 1, timeout_s=10)
        assert {g.key for g in b.groups} == {("a0", 2), ("a0", 3)}
        wait_for(lambda: srv.stats()["buffer/dropped_rolled_back"] == 1.0)
        assert srv.store.invariant_ok() and ("a0", 4) not in srv.store.resident
        actor.close()
        again.close()


def test_a_live_learner_saying_hello_again_is_not_served_what_it_trained(tmp_path):
    """After a buffer restart the learner's Hello names its current step: nothing it trained returns."""
    run = str(tmp_path)
    cfg = make_config(run_dir=run)
    srv = ServerProcess(cfg, run)
    actor, learner = ActorClient(cfg, "a0", resend_s=0.5), LearnerClient(cfg, resend_s=0.5, step=0, version=0)
    try:
        actor.send_many([small(actor.next_seq()) for _ in range(4)])
        assert actor.flush(10)
        trained = _take(learner, 2, 1)
        learner.step, learner.version = 1, 1
        learner.sample(1, 1, timeout_s=0.3)  # lets the Consumed land
        srv.kill()
        srv = ServerProcess(cfg, run)
        b = learner.sample(2, 1, timeout_s=20)
        assert b is not None and not {g.key for g in b.groups} & set(trained)
    finally:
        srv.kill()
        actor.close()
        learner.close()


def test_a_damaged_group_or_file_is_refused_by_name_and_the_rest_kept(tmp_path):
    run = str(tmp_path)
    cfg = make_config(run_dir=run, fsync="always")
    sent = [small(seq) for seq in range(5)]
    with ServerThread(cfg, run):
        actor = ActorClient(cfg, "a0")
        actor.send_many(sent)
        assert actor.flush(10)
        actor.close()
    path = os.path.join(run, "buffer", durable.FILE)
    db = sqlite3.connect(path)
    raw = bytearray(db.execute("SELECT raw FROM groups WHERE seq = 3").fetchone()[0])
    raw[len(raw) // 2] ^= 0x55  # one flipped byte that SQLite itself cannot see
    db.execute("UPDATE groups SET raw = ? WHERE seq = 3", (bytes(raw),))
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match="did not start") as e:
        ServerProcess(cfg, run, timeout_s=20)
    assert path in str(e.value) and "('a0', 3)" in str(e.value) and "--drop-damaged" in str(e.value)
    fix = subprocess.run([sys.executable, "-m", "buffer.durable", "--drop-damaged", os.path.dirname(path)],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert fix.returncode == 0 and "('a0', 3)" in fix.stdout, fix.stdout + fix.stderr
    with ServerThread(cfg, run) as srv:
        assert set(srv.store.resident) == {g.key for g in sent} - {("a0", 3)}
        assert all(srv.store.resident[g.key].raw == encode(g) for g in sent if g.key != ("a0", 3))
        assert ("a0", 3) in srv.store.seen  # a resend is a duplicate, not a new group
    with open(path, "r+b") as f:  # a damaged file: the header overwritten
        f.write(b"\0" * 64)
    with pytest.raises(durable.CorruptStore, match=path):
        durable.DurableStore(os.path.dirname(path))


def test_a_full_disk_stops_the_store_without_losing_what_it_committed(tmp_path):
    """SQLite's own "disk full" (its page limit reached): the write fails with StoreWriteFailed
    (the buffer exits 75, the launcher does not restart it), and a reopened store holds every
    committed group, undamaged."""
    store = durable.DurableStore(str(tmp_path))
    raw = encode(make_group("a0", 0, completions=2, tokens=512))
    store.add(("a0", 0), raw)
    store.commit()
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count={pages + 2}")
    with pytest.raises(durable.StoreWriteFailed, match="could not be written"):
        for seq in range(1, 200):
            store.add(("a0", seq), raw)
            store.commit()
    store.db.close()
    again = durable.DurableStore(str(tmp_path))
    raws, keys = again.load()
    assert ("a0", 0) in [tuple(k) for k in keys] and len(raws) == len(keys) >= 1 and not again.damaged()
    again.close()


def test_a_learner_hello_naming_impossible_weights_is_refused_and_counted(tmp_path):
    """A step with a negative version would drop every trained group as "rolled back": refused."""
    run = str(tmp_path)
    cfg = make_config(run_dir=run)
    with ServerThread(cfg, run) as srv:
        bad = LearnerClient(cfg, step=3, version=-1)
        with pytest.raises(RuntimeError, match="bad_hello"):
            bad.sample(1, 0, timeout_s=10)
        bad.close()
        assert srv.stats()["buffer/dropped_invalid/bad_hello"] == 1.0


def test_an_add_commits_at_once_a_learners_mark_alone_within_lazy_commit_s(tmp_path, monkeypatch):
    """Acks wait on their group's commit, so a turn with an add commits; marks alone (trained,
    dropped, covered) ride with the next one, or are committed once they have waited LAZY_COMMIT_S."""
    monkeypatch.setattr(durable, "LAZY_COMMIT_S", 0.3)
    store = durable.DurableStore(str(tmp_path))
    other = sqlite3.connect(store.path)  # what a restarted buffer would read
    state = lambda: other.execute("SELECT state FROM groups WHERE seq = 0").fetchone()  # noqa: E731
    try:
        store.add(("a0", 0), encode(small(0)))
        store.commit()
        assert state() == (durable.RESIDENT,)
        store.trained([("a0", 0)], 5)
        store.commit()
        assert state() == (durable.RESIDENT,)  # not yet: no ack depends on it
        store.add(("a0", 1), encode(small(1)))
        store.done([("a0", 7)])  # a mark after an add, in the same turn
        store.commit()
        assert state() == (durable.TRAINED,)  # carried by the add's commit
        store.trained([("a0", 1)], 6)
        time.sleep(0.35)
        store.commit()
        assert other.execute("SELECT state FROM groups WHERE seq = 1").fetchone() == (durable.TRAINED,)
    finally:
        other.close()
        store.close()


@pytest.mark.parametrize("cut", [0.7, 0.3])
def test_a_truncated_store_is_named_never_taken_for_a_torn_tail(tmp_path, cut):
    """A store file cut short (a copy interrupted, a disk that lost its end) is not a crash's torn
    write (SQLite recovers those from its WAL): it is refused by name, and nothing is loaded --
    a store silently shortened would lose acknowledged groups and let their keys be reused."""
    run = str(tmp_path)
    cfg = make_config(run_dir=run, fsync="always")
    with ServerThread(cfg, run):
        actor = ActorClient(cfg, "a0")
        actor.send_many([small(seq) for seq in range(40)])
        assert actor.flush(10)
        actor.close()
    path = os.path.join(run, "buffer", durable.FILE)
    os.truncate(path, int(os.path.getsize(path) * cut) // 4096 * 4096)
    with pytest.raises((durable.CorruptStore, RuntimeError), match="damaged|did not start") as e:
        ServerProcess(cfg, run, timeout_s=20)
    assert path in str(e.value)
