"""The rollout worker without sockets: admission after a resume starts from the version of the
first weights it applies; groups leave in completion order."""

import threading

from actor.curriculum import LengthCurriculum
from actor.worker import RolloutWorker
from tests.support.tiny import tiny_cfg


class Engine:
    """Publishes nothing for a while, then a resumed learner's version 7."""

    def __init__(self, polls_before=3, version=7):
        self.polls, self.version, self._v = polls_before, -1, version

    def refresh_weights(self):
        self.polls -= 1
        if self.polls < 0:
            self.version = self._v
        return self.version


class Client:
    outstanding = 1  # one group an earlier incarnation left unacked


def _worker(engine, stop=None):
    w = RolloutWorker.__new__(RolloutWorker)  # the admission logic alone: no sockets, no model
    w.cfg = tiny_cfg("learner.groups_per_step=4", "actor.num_actors=2", "buffer.max_staleness=1", resolved=False)
    w.index, w.engine, w.client, w.stop, w.admission = 0, engine, Client(), stop or threading.Event(), None
    w.run_dir, w.actor_id = "", "actor0"  # no run directory: no heartbeat
    return w


def test_quota_counts_from_the_first_applied_version():
    w = _worker(Engine())
    assert w._wait_for_weights(timeout_s=10)
    share, s = 2, 1
    # at version 7 the actor may have (S + 7 + 1) * share started; everything before 7 is
    # consumed, so only (S + 1) * share minus what is still in flight may start now
    assert w.admission.allowed(7) == (s + 1) * share - 1
    assert w.admission.allowed(8) == (s + 2) * share - 1


def test_stop_ends_the_wait_for_weights():
    stop = threading.Event()
    stop.set()
    w = _worker(Engine(polls_before=10**9), stop)
    assert w._wait_for_weights(timeout_s=60) is False and w.admission is None


def test_groups_leave_in_completion_order_before_the_batch_ends():
    """With continuous batching the worker yields a group as soon as its last sample is done,
    while other sequences are still decoding: its bytes reach the buffer before the long tail."""
    import random

    from tests.support.tiny import tiny_engine, tiny_task

    class Seq:
        n = 0

        def next_seq(self):
            Seq.n += 1
            return Seq.n

    engine = tiny_engine()
    engine.max_batch = 2
    forwards = []
    real = engine.model.forward
    engine.model.forward = lambda *a, **k: forwards.append(1) or real(*a, **k)
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = tiny_cfg("actor.group_size=2", "actor.skip_uniform_groups=false")  # every group gets a seq
    w.engine, w.client, w.task, w.rng, w.actor_id = engine, Seq(), tiny_task(), random.Random(0), "actor0"
    w.run_dir, w.curriculum = "", LengthCurriculum(w.cfg.actor)
    seen_at = []
    groups = []
    for g in w.generate_groups(w.new_batch(4)):
        seen_at.append(len(forwards))
        groups.append(g)
    assert len(groups) == 4
    assert all(len(g.completions) == 2 for g in groups)
    assert seen_at[0] < len(forwards)  # the first group left while the engine was still decoding
    assert sorted(g.seq for g in groups) == [g.seq for g in groups]  # seqs in sending order


def test_a_group_with_equal_rewards_is_left_out_and_gives_its_admission_slot_back():
    """DAPO's dynamic sampling: equal rewards give zero advantages, so without a KL term such a group
    trains nothing; it is not sent (no seq is spent on it) and its admission slot comes back at once.
    After MAX_UNIFORM_IN_A_ROW of them in a row they are sent anyway, so the learner is never starved."""
    import msgspec

    from actor.worker import MAX_UNIFORM_IN_A_ROW
    from core.admission import Admission
    from tests.support.synth import make_group

    class Sink:
        def __init__(self):
            self.sent = []

        def send_many(self, groups):
            self.sent += groups

    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg, w.client, w.admission = tiny_cfg(resolved=False), Sink(), Admission(share=2, max_staleness=1)
    w.admission.start(4)
    assert w._no_signal([1.0, 0.0, 1.0]) is False and w._no_signal([0.0, 0.0, 0.0]) is True
    keep = make_group("actor0", 5)
    w._hand_over(msgspec.structs.replace(keep, seq=-1))
    w._hand_over(keep)
    assert w.client.sent == [keep] and w.uniform == 1 and w.admission.returned == 1
    assert w.admission.allowed(0) == (1 + 0 + 1) * 2 - 3  # 4 started, 1 given back

    streak = [w._no_signal([1.0, 1.0]) for _ in range(MAX_UNIFORM_IN_A_ROW + 1)]  # one already in the row
    assert streak == [True] * (MAX_UNIFORM_IN_A_ROW - 1) + [False, False]
    assert w._no_signal([0.0, 1.0]) is False and w._no_signal([1.0, 1.0]) is True  # a new row starts
    for off in ("actor.skip_uniform_groups=false", "learner.kl_beta=0.01"):  # a KL term trains on them
        w.cfg, w._uniform_streak = tiny_cfg(off, resolved=False), 0
        assert w._no_signal([0.0, 0.0]) is False
