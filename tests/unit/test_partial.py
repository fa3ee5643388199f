"""Resume inside a generation (actor/partial.py): the engine continues a saved prefix exactly where it
stopped, keeping its log-probs and versions; a saved batch round-trips, hostile or mismatched files are set
aside, and a group already too stale is dropped; the worker resumes a saved batch and sends every group once."""

import os
import random

import msgspec
import numpy as np
import pytest
import torch

from actor import partial
from actor.curriculum import LengthCurriculum
from actor.engines import Sample
from actor.worker import RolloutWorker
from tests.support.tiny import tiny_cfg, tiny_engine, tiny_task


def _prompt():
    task = tiny_task()
    return task, list(task.sample(random.Random(3), "train").tokens)


def test_a_prefix_is_continued_where_it_stopped_keeping_its_logprobs_and_versions():
    task, prompt = _prompt()
    engine = tiny_engine()
    engine.eos_ids = torch.tensor([-1])  # no EOS: every sequence runs to its limit
    full = engine.generate([prompt], max_new_tokens=12, greedy=True)[0]
    assert len(full.tokens) == 12 and full.finish_reason == "length"
    k = 5
    prefix = Sample(full.tokens[:k], [x - 1.0 for x in full.logprobs[:k]], [3] * k, "")  # marked: kept as saved
    out = engine.generate([prompt], max_new_tokens=12, greedy=True, prefixes=[prefix])[0]
    assert out.tokens == full.tokens  # the continuation is the same greedy path, so its positions are right
    assert out.logprobs[:k] == prefix.logprobs and out.versions[:k] == [3] * k
    assert out.versions[k:] == [engine.version] * (12 - k)
    assert torch.allclose(torch.tensor(out.logprobs[k:]), torch.tensor(full.logprobs[k:]), atol=1e-4)
    mixed = engine.generate([prompt, prompt], max_new_tokens=12, greedy=True, prefixes=[None, prefix])
    assert mixed[0].tokens == full.tokens and mixed[1].versions[:k] == [3] * k


def test_a_prefix_that_cannot_be_continued_is_refused():
    _, prompt = _prompt()
    engine = tiny_engine()
    done = Sample([1, 2], [0.0, 0.0], [0, 0], "stop")
    with pytest.raises(ValueError, match="prefix 0"):
        engine.generate([prompt], max_new_tokens=4, prefixes=[done])
    with pytest.raises(ValueError, match="prefix 0"):
        engine.generate([prompt], max_new_tokens=2, prefixes=[Sample([1, 2], [0.0, 0.0], [0, 0], "")])
    with pytest.raises(ValueError, match="prefix 0"):
        engine.generate([prompt], max_new_tokens=4, prefixes=[Sample([1, 2], [0.0], [0, 0], "")])
    engine.supports_prefixes = False
    with pytest.raises(ValueError, match="cannot continue"):
        engine.generate([prompt], max_new_tokens=4, prefixes=[Sample([1], [0.0], [0], "")])


def _group(versions, seq=-1, finished=False):
    sample = partial.Sample([5] * len(versions), [-0.5] * len(versions), versions, "stop" if finished else "")
    return partial.SavedGroup("p1", [1, 2, 3], "default", 0.0, "7", 8, [sample, None], seq)


def test_a_saved_batch_round_trips_and_a_bad_one_is_set_aside(tmp_path):
    where = partial.path(str(tmp_path), "actor0")
    assert partial.load(where, "actor0", 2) is None
    batch = partial.SavedBatch("actor0", 4, [_group([4, 5]), _group([2, 3])])
    partial.save(where, batch)
    assert os.stat(where).st_mode & 0o777 == 0o600
    assert partial.load(where, "actor0", 2) == batch
    assert partial.load(where, "actor1", 2) is None and os.path.exists(where + ".bad")  # another actor's
    for bad in (b"\x93garbage", msgspec.msgpack.encode(partial.SavedBatch("actor0", 4, [_group([4, 5])]))[:-3],
                msgspec.msgpack.encode(partial.SavedBatch("actor0", 4, [partial.SavedGroup(
                    "p", [1], "default", 0.0, "", 8, [partial.Sample([1, 2], [0.0], [0, 0]), None])])),
                msgspec.msgpack.encode(partial.SavedBatch("actor0", 4, [_group([4, 5], seq=3)]))):  # unfinished
        with open(where, "wb") as f:
            f.write(bad)
        assert partial.load(where, "actor0", 2) is None and not os.path.exists(where)
    assert partial.load(where, "actor0", 3) is None  # the group size changed


def test_a_group_already_too_stale_is_dropped_one_handed_over_is_not():
    batch = partial.SavedBatch("actor0", 2, [_group([4, 5]), _group([2, 6]), _group([], seq=-1),
                                             _group([1, 1], seq=9, finished=True)])
    kept, dropped = partial.split(batch, version=5, max_staleness=2)
    assert dropped == [batch.groups[1]]  # its oldest token is 3 versions behind
    assert batch.groups[2] in kept  # no token yet: what it samples now is fresh
    assert batch.groups[3] in kept  # handed over under seq 9: re-sent, the buffer decides
    assert partial.tokens(dropped) == 2


class _Client:
    outstanding = 0

    def __init__(self, pending=()):
        self.n, self.sent, self.resent, self._pending = 100, [], [], set(pending)

    def next_seq(self):
        self.n += 1
        return self.n

    def resend(self, groups):  # as ActorClient.resend: a seq sent again is never issued again
        new = [g for g in groups if g.seq not in self._pending]
        self.resent += new
        self.n = max([self.n, *(g.seq for g in new)])
        return len(new)


class _Admission:
    started = 0

    def start(self, n):
        self.started += n


def _worker(tmp_path, engine, client):
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = tiny_cfg("actor.group_size=2", "actor.skip_uniform_groups=false", "actor.partial_save_s=0.001",
                     "buffer.max_staleness=2")
    w.engine, w.client, w.task, w.rng, w.actor_id = engine, client, tiny_task(), random.Random(0), "actor0"
    w.run_dir, w.curriculum, w.admission = "", LengthCurriculum(w.cfg.actor), _Admission()
    w.partial_path = partial.path(str(tmp_path), "actor0")
    engine.on_step = w._on_step
    return w


def test_the_worker_saves_mid_batch_and_a_new_incarnation_continues_it(tmp_path):
    """Saved while decoding (every step here); a new worker reads the file: the group handed over before the
    'kill' is re-sent under its seq, the others continue from their prefixes, nothing is generated twice."""
    engine = tiny_engine(temperature=3.0)
    engine.eos_ids, engine.max_batch = torch.tensor([-1]), 2  # every sample runs to its limit, two at a time
    w = _worker(tmp_path, engine, _Client())
    batch = w.new_batch(3)
    batch.limits = [10, 10, 10]
    stream = w.generate_groups(batch)
    first = next(stream)  # group 0 done (its two samples ran first); group 1's start next
    steps = []

    def killed_after_four_steps():
        w._on_step()  # saves (partial_save_s is 1 ms)
        steps.append(1)
        if len(steps) > 4:
            raise RuntimeError("SIGKILL")

    engine.on_step = killed_after_four_steps
    with pytest.raises(RuntimeError, match="SIGKILL"):
        next(stream)
    saved = partial.load(w.partial_path, "actor0", 2)
    assert saved is not None and saved.groups[0].seq == first.seq  # listed with its seq before handing over
    engine.version = 2  # the learner moved on meanwhile; within max_staleness of the prefixes (version 0)
    engine.weights = None
    w2 = _worker(tmp_path, engine, _Client())
    resumed = w2._resume()
    assert [g.seq for g in w2.client.resent] == [first.seq]  # not in the new client's spool: sent again
    saved_prefixes = {(i, j): s for i, g in enumerate(saved.groups[1:]) for j, s in enumerate(g.samples) if s}
    groups = list(w2.generate_groups(resumed))
    assert len(groups) == 2 and all(g.seq > first.seq for g in groups)
    for (i, j), s in saved_prefixes.items():
        c = groups_by_prompt(groups, saved.groups[1 + i].prompt)[j]
        tokens, versions = _ints(c.tokens), _ints(c.versions)
        assert tokens[: len(s.tokens)] == s.tokens and versions[: len(s.tokens)] == s.versions
        assert set(versions[len(s.tokens):]) == {2} and len(tokens) == 10
    assert w2.restart["actor/resumed_tokens"] == partial.tokens(saved.groups[1:]) > 0
    assert w2.admission.started == 1  # the re-sent group; the resumed ones are counted by run()


def _ints(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype=np.int32).tolist()


def groups_by_prompt(groups, prompt):
    return next(g for g in groups if _ints(g.prompt_tokens) == prompt).completions


def test_a_saved_group_too_stale_to_continue_is_dropped_and_counted_in_the_funnel(tmp_path):
    w = _worker(tmp_path, tiny_engine(), _Client())
    partial.save(w.partial_path, partial.SavedBatch("actor0", 0, [_group([0, 1]), _group([4, 4]), _group([])]))
    w.engine.version = 5  # buffer.max_staleness 2: the first group's version-0 token is 5 behind
    resumed = w._resume()
    assert len(resumed.prompts) == 2 and resumed.done[0][0].versions == [4, 4]
    assert w.restart == {"actor/restart_dropped_groups": 1, "actor/restart_dropped_tokens": 2,
                         "actor/resumed_groups": 2, "actor/resumed_tokens": 2}
    m = w.funnel_metrics()  # generated, then lost: the books still close
    assert m["funnel/generated"] == 1 and m["funnel/restart"] == 1 and m["funnel/len/<=64"] == 1
