"""Binding policy and CURVE: loopback by default, no plaintext on other interfaces, and with CURVE
only a client holding the configured key pair and the server's public key gets anything through."""

import time

import msgspec
import pytest
import zmq

from buffer.client import ActorClient, LearnerClient
from buffer.server import BufferServer
from core import net
from core.messages import Hello, encode
from tests.support.buffer import ServerThread, make_config
from tests.support.synth import make_group


def test_default_bind_is_loopback(tmp_path):
    cfg = make_config(run_dir=tmp_path)
    srv = BufferServer(cfg, str(tmp_path))
    try:
        assert cfg.net.host == "127.0.0.1"
        endpoint = srv.actor_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        assert endpoint == f"tcp://127.0.0.1:{cfg.net.buffer_actor_port}"
    finally:
        srv.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_non_loopback_bind_without_curve_is_refused(tmp_path, host):
    cfg = make_config(run_dir=tmp_path, net_overrides={"host": host})  # (core.config.validate refuses it too)
    with pytest.raises(net.InsecureBindError, match="CURVE"):
        BufferServer(cfg, str(tmp_path))
    # and nothing was left bound or opened on the way out
    probe = zmq.Context().socket(zmq.ROUTER)
    probe.bind(f"tcp://127.0.0.1:{cfg.net.buffer_actor_port}")
    probe.close(linger=0)


def _curve_config(run_dir):
    """A buffer config with fresh CURVE keys; returns it with (server public, client pair)."""
    spub, ssec = net.make_curve_keys()
    cpub, csec = net.make_curve_keys()
    cfg = make_config(run_dir=run_dir, net_overrides=dict(curve_server_public=spub, curve_server_secret=ssec,
                                                          curve_client_public=cpub, curve_client_secret=csec))
    return cfg, (spub, cpub, csec)


def test_curve_lets_only_authenticated_clients_through(tmp_path):
    cfg, (spub, cpub, csec) = _curve_config(tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        ctx = zmq.Context()
        intruders = {}

        def intruder(name, curve):
            s = net.socket(ctx, zmq.DEALER)
            net.connect(s, cfg.net.host, cfg.net.buffer_actor_port, curve)
            s.send(encode(Hello("actor", name)))
            s.send(encode(make_group(name, 0, completions=2, tokens=8)))
            intruders[name] = s

        other_pub, other_sec = net.make_curve_keys()
        stranger_pub, stranger_sec = net.make_curve_keys()
        intruder("plaintext", None)
        intruder("wrong_server_key", net.Curve(server_public=other_pub.encode(), client_public=cpub.encode(),
                                               client_secret=csec.encode()))
        intruder("unknown_client_key", net.Curve(server_public=spub.encode(),
                                                 client_public=stranger_pub.encode(),
                                                 client_secret=stranger_sec.encode()))

        actor, learner = ActorClient(cfg, "good"), LearnerClient(cfg)
        actor.send(make_group("good", actor.next_seq(), completions=2, tokens=8))
        assert actor.flush(10)
        batch = learner.sample(1, 0, timeout_s=10)
        assert [g.key for g in batch.groups] == [("good", 0)]

        time.sleep(1.0)  # give the intruders every chance to get a frame through
        assert srv.store.counters.accepted == 1
        assert all(("%s" % name, 0) not in srv.store.seen for name in intruders)
        assert set(srv._actor_ident) == {"good"}  # no intruder was ever heard, not even its Hello
        for name, s in intruders.items():
            assert not s.poll(0), f"{name} received an answer"
            s.close()
        actor.close()
        learner.close()
        ctx.term()


def test_curve_learner_with_plaintext_gets_no_batch(tmp_path):
    cfg, (spub, cpub, csec) = _curve_config(tmp_path)
    with ServerThread(cfg, str(tmp_path)) as srv:
        actor = ActorClient(cfg, "good")
        actor.send(make_group("good", actor.next_seq(), completions=2, tokens=8))
        assert actor.flush(10)
        plain = msgspec.structs.replace(cfg, net=msgspec.structs.replace(
            cfg.net, curve_server_public="", curve_client_public="", curve_client_secret=""))
        thief = LearnerClient(plain)
        assert thief.sample(1, 0, timeout_s=1.0) is None
        assert srv.store.leased == 0 and srv.store.available() == 1
        thief.close()
        actor.close()


def test_curve_without_a_client_allow_list_is_refused_even_past_config_validation(tmp_path):
    """The attack: a non-loopback bind with server keys only was accepted and then answered any
    key pair. Config validation refuses it (tests/unit/test_config_net.py); the server refuses
    it too, for a config built without validation."""
    spub, ssec = net.make_curve_keys()
    for host in ("127.0.0.1", "0.0.0.0"):
        cfg = make_config(run_dir=tmp_path, net_overrides=dict(host=host, curve_server_public=spub,
                                                               curve_server_secret=ssec))
        with pytest.raises(net.InsecureBindError, match="allow-list"):
            BufferServer(cfg, str(tmp_path))


def test_a_list_allow_list_admits_each_listed_key_and_no_other(tmp_path):
    spub, ssec = net.make_curve_keys()
    pairs = [net.make_curve_keys() for _ in range(3)]
    cfg = make_config(run_dir=tmp_path, net_overrides=dict(
        curve_server_public=spub, curve_server_secret=ssec, curve_client_public=[p for p, _ in pairs[:2]]))

    def as_client(i):  # each client knows only its own secret; its public key is derived
        return msgspec.structs.replace(cfg, net=msgspec.structs.replace(cfg.net, curve_client_secret=pairs[i][1]))

    with ServerThread(cfg, str(tmp_path)) as srv:
        actors = [ActorClient(as_client(i), f"a{i}", timeout_s=2.0) for i in range(3)]
        for a in actors[:2]:
            a.send(make_group(a.actor_id, a.next_seq(), completions=2, tokens=8))
            assert a.flush(10)
        with pytest.raises(Exception, match="no answer"):  # its handshake never completes
            actors[2].next_seq()
        assert sorted(srv.store.resident) == [("a0", 0), ("a1", 0)] and set(srv._actor_ident) == {"a0", "a1"}
        for a in actors:
            a.close()
