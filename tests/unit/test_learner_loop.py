"""The learner loop's step on bad batches and its recovery, on the tiny model with a fake buffer
client (the loop's own logic; the real sockets are in tests/integration)."""

import json
import os

import pytest
import torch

from learner import audit as A
from learner.loop import LearnerLoop
from tests.support.tiny import make_group, tiny_cfg, tiny_model_dir

torch.set_num_threads(1)


class FakeClient:
    def __init__(self):
        self.consumed_calls, self.restarts, self.served = [], [], []
        self.step = self.version = -1

    def consumed(self, keys, version, step=-1):
        self.consumed_calls.append((list(keys), version, step))

    def restart(self, step, version):
        self.restarts.append((step, version))

    def sample(self, n, version, timeout_s=None, **control):
        from core.messages import SampleBatch

        out, self.served = self.served[:n], self.served[n:]
        return SampleBatch(0, out, 0) if out else None

    def close(self):
        pass


class FakeSink:
    def __init__(self):
        self.records = []

    def emit(self, step, values):
        self.records.append((step, values))

    def close(self):
        pass


def _vocab():
    with open(os.path.join(tiny_model_dir(), "config.json")) as f:
        return json.load(f)["vocab_size"]


def _loop(run_dir, *extra):
    cfg = tiny_cfg("learner.groups_per_step=2", "actor.group_size=4", "learner.body_dtype=float32",
                   "weightsync.transport=filesystem", f"model.vocab_size={_vocab()}", *extra)
    return LearnerLoop(cfg, str(run_dir), client=FakeClient(), metrics=FakeSink())


def _group(seq, size=4, token=9, version=0):
    comps = [([token, 4 + k, 2], [-2.0, -2.1, -2.2], [version] * 3, "stop", float(k == 0)) for k in range(size)]
    return make_group([1, 7, 11, 8], comps, seq=seq)


def _consumed_keys(loop):
    return [tuple(k) for keys, _, _ in loop.client.consumed_calls for k in keys]


def _nothing_trained(loop, run_dir):
    assert loop.step == 0 and loop.version == 0
    assert not os.path.exists(run_dir / A.TRAINED)
    assert all(step == -1 for _, _, step in loop.client.consumed_calls)  # never trained: forgotten


@pytest.mark.parametrize("vocab_checked", [True, False])
def test_out_of_vocabulary_batch_is_skipped_not_fatal(tmp_path, vocab_checked, caplog):
    """Rejected by collate's check, or (unchecked) failing inside the forward pass: either way
    the batch is dropped, its groups consumed, nothing trained."""
    loop = _loop(tmp_path, *([] if vocab_checked else ["model.vocab_size=0"]))
    bad = [_group(0), _group(1, token=_vocab() + 5)]
    before = {k: v.clone() for k, v in loop.backend.named_tensors().items()}
    assert loop.train_step(bad) == (None, None)
    _nothing_trained(loop, tmp_path)
    assert sorted(_consumed_keys(loop)) == sorted(g.key for g in bad)
    assert loop.counts["skipped_batches"] == 1
    assert "skipped" in caplog.text and ("vocabulary" in caplog.text or "IndexError" in caplog.text)
    after = loop.backend.named_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in loop.backend.model.parameters())  # nothing left for the next step
    loop.close()


def test_unequal_group_sizes_are_skipped_then_training_goes_on(tmp_path):
    loop = _loop(tmp_path)
    assert loop.train_step([_group(0), _group(1, size=2)]) == (None, None)
    _nothing_trained(loop, tmp_path)
    assert loop.counts["skipped_batches"] == 1 and len(_consumed_keys(loop)) == 2
    assert loop.metrics.records[-1][1]["learner/skipped_batches"] == 1.0  # reported at once, not next step

    good = [_group(2), _group(3)]
    m, batch = loop.train_step(good)
    assert m is not None and (loop.step, loop.version) == (1, 1)
    with open(tmp_path / A.TRAINED) as f:
        assert [json.loads(line)["keys"] for line in f] == [[list(g.key) for g in good]]
    assert loop.client.consumed_calls[-1] == ([g.key for g in good], 1, 1)  # kept until a checkpoint covers step 1
    loop._emit(m, batch, 0.0, 0.1, 0.0)
    assert loop.metrics.records[-1][1]["learner/skipped_batches"] == 1.0
    loop.close()


def test_a_broken_learner_still_stops(tmp_path):
    """Only a long run of failures -- not one bad batch -- ends the learner."""
    loop = _loop(tmp_path)
    with pytest.raises(RuntimeError, match="in a row"):
        for i in range(100):
            loop.train_step([_group(2 * i), _group(2 * i + 1, size=2)])
    loop.close()


def test_restart_continues_from_the_checkpoint_with_a_fresh_version(tmp_path):
    loop = _loop(tmp_path, "buffer.max_staleness=10")
    loop.train_step([_group(0), _group(1)])
    loop.save()  # checkpoint at step 1, version 1
    ck_weights = {k: v.clone() for k, v in loop.backend.named_tensors().items()}
    loop.train_step([_group(2), _group(3, version=1)])
    loop.train_step([_group(4, version=2), _group(5, version=2)])  # sampled by weights about to be lost
    loop.close()  # ... and the process dies here

    again = _loop(tmp_path, "buffer.max_staleness=10")
    assert (again.step, again.version) == (1, 4)  # newest published was 3: never go back to 1
    assert all(torch.equal(ck_weights[k], v) for k, v in again.backend.named_tensors().items())
    with open(tmp_path / A.TRAINED) as f:
        assert [json.loads(line)["step"] for line in f] == [1]
    with open(tmp_path / A.ROLLED_BACK) as f:
        assert [json.loads(line)["step"] for line in f] == [2, 3]
    # the buffer serves step 2's groups again (step 3's, every token newer than version 1, it drops)
    again.client.served = [_group(2), _group(3, version=1), _group(0)]
    groups = again._fetch(t_start=float("inf"))
    assert [g.key for g in groups] == [("t", 2), ("t", 3)]
    m, _ = again.train_step(groups)
    assert m is not None and (again.step, again.version) == (2, 5)
    with open(tmp_path / A.TRAINED) as f:
        steps = [json.loads(line) for line in f]
    assert [(s["step"], s["version"]) for s in steps] == [(1, 1), (2, 5)]
    keys = [tuple(k) for s in steps for k in s["keys"]]
    assert len(keys) == len(set(keys))
    # ("t", 0), in the checkpoint, served again after a lost Consumed, is never trained again
    again.client.served = [_group(0), _group(6, version=5), _group(7, version=5)]
    assert [g.key for g in again._fetch(t_start=float("inf"))] == [("t", 6), ("t", 7)]
    assert ([("t", 0)], 5, 1) in again.client.consumed_calls
    again.close()


def test_a_restarted_learner_spends_what_is_left_of_the_time_budget(tmp_path):
    """``run.max_time_s`` counts from the launch (``--t0``): a learner restarted after a crash
    late in the run stops at once instead of beginning a fresh budget. (The fake buffer has no
    data: with budget left, ``run`` would wait for groups until the budget ran out.)"""
    import time

    loop = _loop(tmp_path, "run.max_time_s=30")
    t0 = time.time()
    loop.run(t_start=time.time() - 31)  # launched 31 s ago, budget 30 s
    assert time.time() - t0 < 10 and loop.step == 0
    assert loop.budget_left(time.time() - 29) and not loop.budget_left(time.time() - 31)
    loop.close()


def test_a_long_step_beats_per_micro_batch_and_per_checkpoint_file(tmp_path, monkeypatch):
    """Liveness is progress: a step of many micro-batches, and a checkpoint's hashing, touch the
    learner's heartbeat from inside (a slow step on a loaded machine is not taken for a hang)."""
    from core import heartbeat as H

    loop = _loop(tmp_path, "learner.micro_batch_tokens=8")  # one row per micro-batch
    H.beat(str(tmp_path), "learner")  # the loop's own beat names the role
    pulses = []
    monkeypatch.setattr(H, "beat", lambda run_dir, role: pulses.append((run_dir, role)))
    m, batch = loop.train_step([_group(0), _group(1)])
    assert m is not None and len(pulses) >= batch.ids.shape[0] >= 8
    assert set(pulses) == {(str(tmp_path), "learner")}
    pulses.clear()
    loop.save()
    assert len(pulses) >= 3  # one per file hashed
    loop.close()
