"""The hung-role rule and the restart backoff (core/heartbeat.py), pure, on a made-up clock; and
the heartbeat file itself on a temporary directory."""

import os

import pytest

from core import heartbeat as H


def test_a_role_that_beats_is_never_hung():
    w = H.Watch(None, seen_at=100.0)
    for t in range(101, 1000, 5):  # a beat every 5 s, the file's stamp on the role's own clock
        w = H.observe(w, stamp=float(t) - 3600.0, now=float(t))  # an hour of clock skew: irrelevant
        assert H.hung_for(w, float(t) + 4.0, timeout_s=10.0) is None


def test_silence_past_the_timeout_is_hung_after_the_first_beat():
    w = H.observe(H.Watch(None, 0.0), stamp=5.0, now=5.0)
    assert w.beaten
    assert H.hung_for(w, 5.0 + 9.9, timeout_s=10.0) is None
    quiet = H.hung_for(w, 5.0 + 10.5, timeout_s=10.0)
    assert quiet == pytest.approx(10.5)
    assert H.hung_for(H.observe(w, 5.0, 20.0), 20.0, 10.0) is not None  # an unchanged stamp is no beat


def test_a_restarted_role_gets_its_start_grace_and_the_old_file_is_no_beat():
    w = H.Watch(stamp=42.0, seen_at=1000.0)  # the previous incarnation's last beat
    w = H.observe(w, stamp=42.0, now=1000.0 + H.START_GRACE_S - 1)
    assert not w.beaten and H.hung_for(w, 1000.0 + H.START_GRACE_S - 1, timeout_s=5.0) is None
    assert H.hung_for(w, 1000.0 + H.START_GRACE_S + 1, timeout_s=5.0) is not None
    long = 3 * H.START_GRACE_S  # a timeout longer than the grace applies before the first beat too
    assert H.hung_for(w, 1000.0 + long - 1, timeout_s=long) is None


def test_timeout_zero_is_off():
    w = H.Watch(None, 0.0)
    assert H.hung_for(w, 1e9, timeout_s=0.0) is None


def test_backoff_doubles_and_is_capped():
    delays = [H.backoff_s(1.0, n) for n in range(1, 9)]
    assert delays[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert max(delays) == H.BACKOFF_CAP_S and delays == sorted(delays)
    assert H.backoff_s(0.0, 3) == 0.0
    with pytest.raises(ValueError, match="n = 0"):
        H.backoff_s(1.0, 0)


def test_beat_creates_then_touches_the_file_at_most_once_a_second(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    assert H.mtime(run_dir, "learner") is None
    clock = [500.0]
    monkeypatch.setattr(H.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(H, "_last", {})
    H.beat(run_dir, "learner")
    first = H.mtime(run_dir, "learner")
    assert first is not None
    os.utime(H.path(run_dir, "learner"), (1.0, 1.0))  # so that a touch is visible whatever the fs resolution
    clock[0] += 0.5
    H.beat(run_dir, "learner")
    assert H.mtime(run_dir, "learner") == 1.0  # too soon: no system call
    clock[0] += 0.6
    H.beat(run_dir, "learner")
    assert H.mtime(run_dir, "learner") > 1.0


# ---- the Ray launcher's pure placement rules (core/launchers/ray.py) --------------------------

def _places(**nodes):
    return {name: {"node_id": node, "ip": "10.0.0.1" if node == "a" else "10.0.0.2", "pid": 1}
            for name, node in nodes.items()}


def test_unknown_placement_strategy_is_refused_by_name():
    from core import config as C

    with pytest.raises(C.ConfigError, match=r"\$\.ray\.placement_strategy.*'PAKC'"):
        C.load(None, ["ray.placement_strategy=PAKC"])
    with pytest.raises(C.ConfigError, match=r"\$\.ray\.actor_resources"):
        C.load(None, ["ray.actor_resources={node2 = 0}"])


def test_bundles_fit_the_local_instance_they_start():
    pytest.importorskip("ray")
    from core import config as C
    from core.launchers import ray as R

    cfg = C.load(None, ["actor.num_actors=2", "learner.groups_per_step=4", "ray.actor_resources={n2 = 1}",
                        "ray.learner_gpus=1"])
    bs = R.bundles(cfg)
    assert [b["CPU"] for b in bs] == [1.0] * 4 and bs[1]["GPU"] == 1.0 and bs[2]["n2"] == bs[3]["n2"] == 1.0
    assert R.local_resources(bs) == {"num_cpus": 4, "num_gpus": 1, "resources": {"n2": 2.0}}


def test_one_node_keeps_loopback_two_nodes_need_curve_and_no_shm():
    pytest.importorskip("ray")
    from core import config as C
    from core import net
    from core.launchers import ray as R

    cfg = C.load(None, [])
    same = R.resolve_net(cfg, _places(buffer="a", learner="a", actor0="a"), [5001, 5002])
    assert same.net.host == "127.0.0.1" and (same.net.buffer_actor_port, same.net.buffer_learner_port) == (5001, 5002)
    split = _places(buffer="a", learner="a", actor0="b")
    with pytest.raises(C.ConfigError, match=r"\$\.weightsync\.transport"):
        R.check_placement(cfg, split)
    fs = C.load(None, ["weightsync.transport=filesystem"])
    R.check_placement(fs, split)
    with pytest.raises(C.ConfigError, match=r"curve_server_public"):
        R.resolve_net(fs, split, [5001, 5002])
    (spub, ssec), (cpub, csec) = net.make_curve_keys(), net.make_curve_keys()
    keyed = C.load(None, ["weightsync.transport=filesystem", f'net.curve_server_public="{spub}"',
                          f'net.curve_server_secret="{ssec}"', f'net.curve_client_public="{cpub}"',
                          f'net.curve_client_secret="{csec}"'])
    assert R.resolve_net(keyed, split, [5001, 5002]).net.host == "10.0.0.1"  # the buffer's node
    # no role needs the launcher's node (metrics are files): every role on node b keeps loopback
    R.check_placement(cfg, _places(buffer="b", learner="b", actor0="b"))
    assert R.bind_host(cfg, _places(buffer="b", learner="b", actor0="b")) == "127.0.0.1"


def test_the_default_job_never_imports_ray():
    import subprocess
    import sys

    from tests.support.runs import ROOT

    code = ("import sys, run; from core import config as C; from core.launchers import make_launcher; "
            "make_launcher(C.load(None, [])); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
