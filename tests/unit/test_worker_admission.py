"""Actor admission after a resume starts from the version of the first weights it applies."""

import threading

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
    w.index, w.engine, w.client, w.stop, w.admission = 0, engine, Client(), stop, None
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
