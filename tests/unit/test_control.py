"""learner/control.py: the adaptive staleness limit and the guard-rails, as pure logic; then the
learner loop acting on them (guard before the optimiser, skip, pause, rollback) on the tiny model
with a fake buffer client, as tests/unit/test_learner_loop.py does."""

import json
import math
import os

import msgspec
import pytest
import torch

from core import config as C
from learner import audit as A
from learner.control import GUARDS, Control, GuardRails, Poisoned, StalenessController, highest_lag
from tests.unit.test_learner_loop import FakeClient as LoopFakeClient  # noqa: E402
from tests.unit.test_learner_loop import FakeSink  # noqa: E402

torch.set_num_threads(1)


def _by_lag(**p99s):
    """Step metrics with ``ratio/p99_by_staleness/<lag>`` values, e.g. ``_by_lag(l0=1.0, l2=1.4)``."""
    return {f"ratio/p99_by_staleness/{k[1:]}": float(v) for k, v in p99s.items()}


def _ctl(limit=2, lo=0, hi=4, target=1.3, hysteresis=0.1, dwell=0):
    return StalenessController(limit, lo, hi, target, hysteresis, dwell)


# ---- the staleness controller ----------------------------------------------------------------

def test_highest_lag_present_is_the_one_judged():
    assert highest_lag(_by_lag(l0=9.0, l1=1.0, l3=1.2)) == (3, 1.2)
    assert highest_lag({"ratio/p99": 1.0, "ratio/p99_by_staleness/2": math.nan}) is None


def test_raises_under_low_mismatch_up_to_the_upper_bound():
    c = _ctl(limit=1, hi=3)
    limits = [c.update(step, _by_lag(l0=1.0, l1=1.02)).limit for step in range(1, 6)]
    assert limits == [2, 3, 3, 3, 3] and c.changes == 2


def test_lowers_when_mismatch_is_injected_down_to_the_lower_bound():
    c = _ctl(limit=3, lo=1)
    d = c.update(1, _by_lag(l0=1.01, l3=1.42))
    assert (d.limit, d.changed) == (2, True)
    assert "lag 3" in d.reason and "1.420" in d.reason and "target 1.300" in d.reason and "3 -> 2" in d.reason
    assert [c.update(s, _by_lag(l2=2.0)).limit for s in (2, 3, 4)] == [1, 1, 1]


def test_hysteresis_band_holds():
    c = _ctl(limit=2, target=1.3, hysteresis=0.1)  # raise below 1.17, lower above 1.30
    for p99 in (1.171, 1.25, 1.3):
        d = c.update(10, _by_lag(l2=p99))
        assert (d.limit, d.changed) == (2, False) and d.reason.startswith("hold")
    assert c.update(11, _by_lag(l2=1.169)).limit == 3
    assert c.update(12, _by_lag(l3=1.301)).limit == 2


def test_dwell_blocks_changes_right_after_one():
    c = _ctl(limit=2, dwell=3)  # the start counts as a change at step 0
    assert [c.update(s, _by_lag(l2=1.0)).limit for s in (1, 2, 3, 4, 5, 6)] == [2, 2, 3, 3, 3, 4]
    d = c.update(7, _by_lag(l4=5.0))
    assert not d.changed and "dwell" in d.reason
    assert c.update(9, _by_lag(l4=5.0)).limit == 3


def test_a_worked_example():
    # target 1.30, hysteresis 0.1 (raise below 1.17), dwell 2, limit 2 at step 0: hold (dwell), raise 2 -> 3,
    # hold (dwell), lower 3 -> 2 (1.40 > 1.30), hold (1.17 <= 1.20 <= 1.30)
    c = StalenessController(2, 1, 4, 1.3, 0.1, 2)
    got = [(c.update(step, _by_lag(**{f"l{lag}": p99})).limit) for step, lag, p99 in
           [(1, 2, 1.05), (2, 2, 1.05), (3, 3, 1.40), (4, 3, 1.40), (6, 2, 1.20)]]
    assert got == [2, 3, 3, 2, 2]


def test_no_lag_metric_holds():
    d = _ctl().update(5, {"ratio/p99": 9.0})
    assert (d.limit, d.changed) == (2, False)


# ---- the guard-rails -------------------------------------------------------------------------

THRESHOLDS = {"ratio_p99": 2.0, "ratio_max": 10.0, "ratio_min": 0.05, "kl_k3": 0.02, "abs_logp_diff_p99_s0": 0.5}
CLEAN = {"ratio/p99": 1.1, "ratio/max": 1.5, "ratio/min": 0.7, "mismatch/kl_k3": 1e-3,
         "mismatch/abs_logp_diff_p99_by_staleness/0": 0.1, "ratio/p99_by_staleness/0": 1.1}


@pytest.mark.parametrize("name, key, above", GUARDS)
def test_each_guard_fires_at_its_threshold_and_not_short_of_it(name, key, above):
    g = GuardRails(THRESHOLDS)
    t = THRESHOLDS[name]
    assert g.check(CLEAN) == []
    short = t * (0.99 if above else 1.01)
    assert g.check({**CLEAN, key: short}) == []
    for v in (t, t * (1.5 if above else 0.5)):
        trips = g.check({**CLEAN, key: v})
        assert [tr.guard for tr in trips] == [name]
        assert trips[0].value == v and trips[0].threshold == t and key in trips[0].reason


@pytest.mark.parametrize("off", [0.0, None])
def test_a_zero_or_none_threshold_turns_its_guard_off(off):
    g = GuardRails({**THRESHOLDS, "ratio_max": off})
    assert g.check({**CLEAN, "ratio/max": 1e6}) == []
    assert [t.guard for t in g.check({**CLEAN, "ratio/p99": 3.0})] == ["ratio_p99"]


def test_lag0_guard_is_not_checked_without_lag0_tokens():
    g = GuardRails(THRESHOLDS)
    m = {k: v for k, v in CLEAN.items() if not k.endswith("/0")}
    assert g.check(m) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_fires(bad):
    trips = GuardRails(THRESHOLDS).check({**CLEAN, "mismatch/kl_k3": bad})
    assert [t.guard for t in trips] == ["nonfinite"] and "mismatch/kl_k3" in trips[0].reason
    assert GuardRails(THRESHOLDS, nonfinite=False).check({**CLEAN, "mismatch/kl_k3": bad}) == []


# ---- Control: counters, pause, the config section ----------------------------------------------

def _control(*overrides, **kw):
    cfg = C.load(None, list(overrides))
    return Control(cfg.control, cfg.buffer.max_staleness, **kw)


def test_control_counts_guards_and_actions_and_pauses_until_clean_steps():
    c = _control("control.guard_action=pause_actors", "control.pause_steps=2", "control.guard_ratio_p99=2.0")
    v = c.observe(1, {**CLEAN, "ratio/p99": 3.0})
    assert v.action == "pause_actors" and not v.blocks_step
    c.pause()
    assert c.paused and not c.after_step(v)  # the firing step itself is not clean
    assert not c.after_step(c.observe(2, CLEAN))
    assert c.after_step(c.observe(3, CLEAN)) and not c.paused
    m = c.metrics()
    assert m["control/guard/ratio_p99"] == 1.0 and m["control/action/pause_actors"] == 1.0
    assert m["control/last_value"] == 3.0 and m["control/last_step"] == 1.0
    assert m["control/max_staleness"] == 2.0 and m["control/staleness_changes"] == 0.0


def test_adaptive_limit_starts_at_buffer_max_staleness_and_reports_changes():
    c = _control("control.adaptive_staleness=true", "control.dwell_steps=0", "control.ratio_p99_target=1.3")
    c.observe(1, _by_lag(l2=1.0))
    assert c.max_staleness == 3 and c.metrics()["control/staleness_changes"] == 1.0


@pytest.mark.parametrize("overrides, field", [
    (["control.guard_action=explode"], "guard_action"),
    (["control.adaptive_staleness=true", "control.staleness_min=3"], "staleness_min"),
    (["control.staleness_min=5", "control.staleness_max=4"], "staleness_max"),
    (["control.guard_ratio_min=1.5"], "guard_ratio_min"),
    (["control.guard_ratio_p99=0.9"], "guard_ratio_p99"),
    (["control.hysteresis=1.0"], "hysteresis"),
])
def test_bad_control_config_names_the_field(overrides, field):
    with pytest.raises(C.ConfigError, match=field):
        C.load(None, overrides)


def test_default_config_guards_are_on_and_warn_only():
    cc = C.Config().control
    assert cc.guard_action == "warn" and not cc.adaptive_staleness and cc.guard_nonfinite
    assert all(getattr(cc, f"guard_{n}") for n, _, _ in GUARDS)


def test_poisoned_intervals_hit_any_token_inside():
    import numpy as np

    p = Poisoned()
    p.add(4, 7)  # versions 5, 6, 7
    p.add(3, 3)  # empty: ignored
    assert p.hit(np.array([2, 3, 5])) and p.hit(np.array([7]))
    assert not p.hit(np.array([3, 4, 8, 9])) and not p.hit(np.array([], dtype=np.int32))
    assert p.intervals == [(4, 7)]


# ---- the buffer follows the learner's control and tells the actors ----------------------------

def test_buffer_follows_the_requested_limit_and_pause_and_tells_idle_actors(tmp_path):
    from buffer.client import ActorClient, LearnerClient
    from tests.support.buffer import ServerThread, make_config, wait_for

    cfg = make_config(run_dir=tmp_path, max_staleness=2, persist=False)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor, learner = ActorClient(cfg, "a0"), LearnerClient(cfg)
        try:
            actor.next_seq()  # its Hello is answered: the buffer knows it
            assert actor.control is None  # nothing departed from the config yet
            assert learner.sample(1, 0, timeout_s=0.3, max_staleness=5, pause_actors=True) is None
            wait_for(lambda: actor.poll(10) is not None and actor.control == (5, True))
            assert srv.store.max_staleness == 5 and srv.paused
            learner.sample(1, 0, timeout_s=0.3, pause_actors=False)  # -1: the limit stays
            wait_for(lambda: actor.poll(10) is not None and actor.control == (5, False))
            assert srv.stats()["buffer/max_staleness"] == 5.0
            late = ActorClient(cfg, "a1")  # an actor that says Hello afterwards is told at once
            try:
                late.next_seq()
                wait_for(lambda: late.poll(10) is not None and late.control == (5, False))
            finally:
                late.close()
        finally:
            actor.close()
            learner.close()


# ---- the learner loop acting on its guards (tiny model, fake buffer client) --------------------

class FakeClient(LoopFakeClient):
    """test_learner_loop's fake buffer client, also recording the control state each request sends."""

    def __init__(self):
        super().__init__()
        self.requests = []

    def sample(self, n, version, timeout_s=None, **control):
        self.requests.append(control)
        return super().sample(n, version, timeout_s)


def _loop(run_dir, *extra):
    from learner.loop import LearnerLoop
    from tests.support.tiny import tiny_cfg, tiny_model_dir

    with open(os.path.join(tiny_model_dir(), "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cfg = tiny_cfg("learner.groups_per_step=2", "actor.group_size=4", "learner.body_dtype=float32",
                   "weightsync.transport=filesystem", f"model.vocab_size={vocab}", "buffer.max_staleness=10",
                   "control.staleness_max=12", "control.guard_ratio_p99=1.5", *extra)
    return LearnerLoop(cfg, str(run_dir), client=FakeClient(), metrics=FakeSink())


def _scored(loop, seq, shift=0.0, versions=(0, 0, 0)):
    """A group whose behaviour log-probs are the learner's own now, minus ``shift`` (a ratio of
    exp(shift) on every token: an injected mismatch)."""
    import numpy as np

    from learner.batching import collate
    from tests.support.tiny import make_group

    prompt = [1, 7, 11, 8]
    comps = [([9, 4 + k, 2], [-1.0] * 3, list(versions), "stop", float(k == 0)) for k in range(4)]
    g = make_group(prompt, comps, seq=seq)
    with torch.no_grad():
        lp, _ = loop.backend.logprobs(collate([g], max(loop.version, max(versions))))
    s = len(prompt) - 1
    return make_group(prompt, [(t, np.minimum(lp[i, s:s + 3].numpy() - shift, 0.0), v, f, r)
                               for i, (t, _, v, f, r) in enumerate(comps)], seq=seq)


def _weights(loop):
    return {k: v.clone() for k, v in loop.backend.named_tensors().items()}


def _trained(run_dir):
    path = os.path.join(run_dir, A.TRAINED)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def test_skip_step_drops_the_batch_before_the_optimiser(tmp_path, caplog):
    loop = _loop(tmp_path, "control.guard_action=skip_step")
    m, _ = loop.train_step([_scored(loop, 0), _scored(loop, 1)])
    assert m is not None and m["ratio/p99"] < 1.5 and loop.step == 1
    before = _weights(loop)
    bad = [_scored(loop, 2, shift=1.0), _scored(loop, 3, shift=1.0)]
    assert loop.train_step(bad) == (None, None)
    assert (loop.step, loop.version) == (1, 1) and [s["step"] for s in _trained(tmp_path)] == [1]
    assert all(torch.equal(before[k], v) for k, v in loop.backend.named_tensors().items())
    assert all(p.grad is None for p in loop.backend.model.parameters())
    assert [tuple(k) for k in loop.client.consumed_calls[-1][0]] == [g.key for g in bad]
    assert "guard-rail" in caplog.text and "ratio/p99" in caplog.text and "skip_step" in caplog.text
    rec = loop.metrics.records[-1][1]
    assert rec["control/guard/ratio_p99"] == 1.0 and rec["control/action/skip_step"] == 1.0
    assert rec["control/last_value"] > 1.5 and rec["control/max_staleness"] == 10.0
    loop.close()


def test_warn_trains_and_counts(tmp_path):
    loop = _loop(tmp_path)  # the default action
    m, batch = loop.train_step([_scored(loop, 0, shift=1.0), _scored(loop, 1, shift=1.0)])
    assert m is not None and loop.step == 1 and loop.control.acted["warn"] == 1
    loop._emit(m, batch, 0.0, 0.1, 0.0)
    assert loop.metrics.records[-1][1]["control/action/warn"] == 1.0
    loop.close()


def test_pause_actors_until_clean_steps(tmp_path):
    loop = _loop(tmp_path, "control.guard_action=pause_actors", "control.pause_steps=2")
    assert loop._control_request() == {}
    m, _ = loop.train_step([_scored(loop, 0, shift=1.0), _scored(loop, 1, shift=1.0)])
    assert m is not None and loop.step == 1  # the step itself goes on
    assert loop.control.paused and loop._control_request() == {"pause_actors": True}
    loop.train_step([_scored(loop, 2), _scored(loop, 3)])
    assert loop.control.paused
    loop.train_step([_scored(loop, 4), _scored(loop, 5)])
    assert not loop.control.paused and loop._control_request() == {}
    loop.close()


def test_pause_ends_when_the_buffer_has_nothing_to_give(tmp_path):
    loop = _loop(tmp_path, "control.guard_action=pause_actors", "run.max_time_s=1.5")
    loop.control.pause()
    import time

    assert loop._fetch(time.time()) is None  # the fake buffer never has a batch
    assert not loop.control.paused and loop.client.requests[0] == {"pause_actors": True}
    loop.close()


def test_rollback_reloads_the_checkpoint_and_never_trains_the_rolled_back_versions(tmp_path, caplog):
    from learner.loop import read_rollbacks

    loop = _loop(tmp_path, "control.guard_action=rollback")
    loop.train_step([_scored(loop, 0), _scored(loop, 1)])
    loop.save()  # checkpoint at step 1, version 1
    ck = _weights(loop)
    loop.train_step([_scored(loop, 2, versions=(1, 1, 1)), _scored(loop, 3, versions=(0, 1, 1))])
    loop.train_step([_scored(loop, 4, versions=(1, 1, 1)), _scored(loop, 5, versions=(1, 2, 2))])
    assert (loop.step, loop.version) == (3, 3)
    bad = [_scored(loop, 6, shift=1.0, versions=(3, 3, 3)), _scored(loop, 7, shift=1.0, versions=(2, 3, 3))]
    assert loop.train_step(bad) == (None, None)
    # the checkpoint's weights, under a fresh version above the newest published (3)
    assert (loop.step, loop.version) == (1, 4)
    assert all(torch.equal(ck[k], v) for k, v in loop.backend.named_tensors().items())
    assert [s["step"] for s in _trained(tmp_path)] == [1]
    # the buffer is told to serve again what steps 2..3 trained; trained again: what versions <= 1
    # sampled; dropped: anything with a token of 2..3
    assert loop.client.restarts == [(1, 1)]
    served = [_scored(loop, k, versions=v) for k, v in ((2, (1, 1, 1)), (3, (0, 1, 1)), (4, (1, 1, 1)), (5, (1, 2, 2)))]
    assert [g.key for g in served if loop._fresh(g)] == [("t", 2), ("t", 3), ("t", 4)]
    assert read_rollbacks(str(tmp_path)) == [(1, 3)]
    assert not loop._fresh(_scored(loop, 8, versions=(1, 2, 4))) and loop._fresh(_scored(loop, 9, versions=(1, 4, 4)))
    assert ("t", 6) in {tuple(k) for keys, _, _ in loop.client.consumed_calls for k in keys}
    assert "rolled back to" in caplog.text
    m, _ = loop.train_step(served[:2])
    assert m is not None and (loop.step, loop.version) == (2, 5)
    loop.close()
    again = _loop(tmp_path, "control.guard_action=rollback")  # a restart keeps the condemned versions
    assert again.poisoned.intervals == [(1, 3)] and not again._fresh(_scored(again, 10, versions=(3, 5, 5)))
    keys = [tuple(k) for s in _trained(tmp_path) for k in s["keys"]]
    assert len(keys) == len(set(keys)) and not {("t", 5), ("t", 6), ("t", 7)} & set(keys)
    again.close()


def test_two_rollbacks_in_a_row_each_publish_a_fresh_version(tmp_path):
    """The guard fires again on the first batch after a rollback, before any step: the second
    rollback's version is above the first's (published, never trained), not equal to it (which
    the publisher refused: the learner crashed and the run starved)."""
    loop = _loop(tmp_path, "control.guard_action=rollback")
    loop.train_step([_scored(loop, 0), _scored(loop, 1)])
    loop.save()  # step 1, version 1
    loop.train_step([_scored(loop, 2, versions=(1, 1, 1)), _scored(loop, 3, versions=(1, 1, 1))])
    assert loop.train_step([_scored(loop, 4, shift=1.0, versions=(2, 2, 2))] * 2) == (None, None)
    assert (loop.step, loop.version) == (1, 3)
    assert loop.train_step([_scored(loop, 5, shift=1.0, versions=(3, 3, 3))] * 2) == (None, None)
    assert (loop.step, loop.version) == (1, 4)
    loop.close()


def test_rollback_without_a_checkpoint_goes_back_to_the_initial_weights(tmp_path):
    loop = _loop(tmp_path, "control.guard_action=rollback")
    initial = _weights(loop)
    loop.train_step([_scored(loop, 0), _scored(loop, 1)])
    assert loop.train_step([_scored(loop, 2, shift=1.0), _scored(loop, 3, shift=1.0)]) == (None, None)
    assert (loop.step, loop.version) == (0, 2) and _trained(tmp_path) == []
    assert all(torch.equal(initial[k], v) for k, v in loop.backend.named_tensors().items())
    # step 1's groups, served again, were sampled by the initial weights (version 0, outside (0, 1]): fresh
    assert loop.client.restarts == [(0, 0)]
    assert loop._fresh(_scored(loop, 0)) and loop._fresh(_scored(loop, 1))
    loop.close()


def test_adaptive_limit_rules_the_learners_own_check_and_its_requests(tmp_path):
    loop = _loop(tmp_path, "control.adaptive_staleness=true", "control.dwell_steps=0", "buffer.max_staleness=1",
                 "control.ratio_p99_target=1.3", "control.guard_ratio_p99=0")
    assert loop._control_request() == {"max_staleness": 1}
    loop.train_step([_scored(loop, 0), _scored(loop, 1)])  # lag 0, ratio ~1: up
    assert loop.control.max_staleness == 2 and loop._control_request() == {"max_staleness": 2}
    loop.train_step([_scored(loop, 2, shift=1.0), _scored(loop, 3, shift=1.0)])  # ratio e: down
    assert loop.control.max_staleness == 1
    loop.version = 5
    assert not loop._fresh(_scored(loop, 4, versions=(3, 3, 3))) and loop._fresh(_scored(loop, 5, versions=(4, 4, 4)))
    loop.close()


def test_live_view_shows_the_limit_and_the_last_trip():
    from rich.console import Console

    from core.messages import MetricRecords
    from core.monitor import Monitor

    mon = Monitor(C.load(None, ["monitor.live=off"]), console=Console(record=True, width=200), live=False)
    c = _control("control.guard_action=skip_step", "control.guard_ratio_p99=2.0")
    mon.update([MetricRecords("learner", "l", 1, 0.0, c.metrics())])
    assert mon.control_text() == "s≤2" and mon.format_line().endswith(" | ctl s≤2")
    c.observe(7, {**CLEAN, "ratio/p99": 3.25, "ratio/min": 0.01})  # two guards: the first is shown
    mon.update([MetricRecords("learner", "l", 7, 0.0, c.metrics())])
    assert "ctl s≤2 · ratio_p99 3.25 vs 2.00 @7 → skip_step" in mon.format_line()
    mon.console.print(mon.renderable())
    assert "ratio_p99 3.25 vs 2.00 @7" in mon.console.export_text()


def test_control_fields_are_trailing_defaults_old_peers_still_decode():
    """Fields are append-only: a request from a peer without the control fields decodes with
    "unchanged" defaults, and the new ones decode for an old peer; control reaches actors as its
    own message, never inside Acks."""
    from core import messages as M

    old_req = msgspec.defstruct("SampleRequest", [("request_id", int), ("num_groups", int), ("learner_version", int)],
                                tag="sample_req", array_like=True)
    old_acks = msgspec.defstruct("Acks", [("acks", list[M.Ack])], tag="acks", array_like=True)
    req = M.decoder(M.LEARNER_TO_BUFFER).decode(msgspec.msgpack.encode(old_req(3, 4, 5)))
    assert (req.max_staleness, req.pause_actors) == (-1, False)
    acks = M.decoder(M.BUFFER_TO_ACTOR).decode(msgspec.msgpack.encode(old_acks([M.Ack("a0", 1, "ok")])))
    assert acks.acks == [M.Ack("a0", 1, "ok")] and not hasattr(acks, "pause")
    ctl = M.decoder(M.BUFFER_TO_ACTOR).decode(M.encode(M.Control(3, True)))
    assert isinstance(ctl, M.Control) and (ctl.max_staleness, ctl.pause) == (3, True)
    new = msgspec.msgpack.decode(M.encode(M.SampleRequest(3, 4, 5, 2, True)), type=old_req)
    assert (new.request_id, new.num_groups, new.learner_version) == (3, 4, 5)
