"""Hostile traffic: >= 10,000 malformed frames through a raw DEALER, then valid traffic.

The server must never crash, must count every bad frame under the reason it deserves, and must
accept every valid group afterwards. Frames between ``max_frame_bytes`` and ZeroMQ's own limit
(max_frame_bytes + ZMQ_SLACK_BYTES) are received and counted as ``oversize``; a frame above the
ZeroMQ limit is cut by ZeroMQ itself (the connection drops, nothing is allocated), so it is not
counted -- one is sent last, on its own connection, to show the server shrugs it off.

Expected reasons come from an oracle built only on ``core.messages`` (the bounded typed decoder
and ``validate_group`` with the run's limits) and the authentication rules (the fuzzing
connection said Hello as actor "fuzz" with the run's secret), never from the server's own code.
Frames of other sockets' messages and of the retired by-reference messages (schema 1 tags) are in
the mix too: the actor socket's decoder refuses them as ``bad_fields``.
"""

import math
import random
from collections import Counter

import msgspec
import numpy as np
import zmq

from buffer.client import ActorClient, LearnerClient
from buffer.server import MAX_GROUPS_PER_MSG, MAX_ID_CHARS, ZMQ_SLACK_BYTES
from core import net
from core.messages import (BUFFER_TO_ACTOR, SCHEMA_VERSION, Ack, Acks, Consumed, Hello, InvalidMessage, Limits,
                           RolloutGroup, SampleRequest, decode_reason, decoder, encode, group_decoder,
                           validate_group)
from tests.support.buffer import ServerThread, make_config, token
from tests.support.synth import make_group

MAX_FRAME = 64 << 10
BATCH = 500
ACTOR = "fuzz"  # the fuzzing connection's actor id


class Oracle:
    def __init__(self, cfg):
        self.limits, self.token = Limits.of(cfg), token(cfg)
        self.dec = group_decoder(self.limits, Hello)

    def __call__(self, frame: bytes) -> str | None:
        """The reason a frame must be refused for, or None if it is acceptable."""
        if len(frame) > MAX_FRAME:
            return "oversize"
        try:
            msg = self.dec.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return decode_reason(e)
        if isinstance(msg, Hello):
            if msg.schema_version != SCHEMA_VERSION:
                return "schema_version"
            if len(msg.id) > MAX_ID_CHARS:
                return "bad_actor_id"
            return "bad_role" if msg.role != "actor" else ("bad_token" if msg.token != self.token else None)
        if len(msg.actor_id) > MAX_ID_CHARS:
            return "bad_actor_id"
        try:
            validate_group(msg, self.limits)
        except InvalidMessage as e:
            return e.reason
        # no learner has reported a version: anything newer than 1 is deferred, not refused
        return "wrong_peer" if msg.actor_id != ACTOR else None


def replace_completion(g, i=0, **kw):
    comps = list(g.completions)
    comps[i] = msgspec.structs.replace(comps[i], **kw)
    return msgspec.structs.replace(g, completions=comps)


def hostile_frames(rng: random.Random, base: list[bytes], groups: list[RolloutGroup], oracle):
    """Yield (frame, category): every category is invalid by construction or checked by the oracle."""
    nan = np.array([math.nan], "<f4").tobytes()
    inf = np.array([-math.inf], "<f4").tobytes()
    for _ in range(3000):
        yield rng.randbytes(rng.randrange(0, 3000)), "random"
    for _ in range(1800):  # any strict prefix of one msgpack value is incomplete
        b = rng.choice(base)
        yield b[: rng.randrange(0, len(b))], "truncated"
    n = 0
    while n < 3000:  # byte flips: kept only when the oracle says they are invalid
        b = bytearray(rng.choice(base))
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(min(len(b), 200) if rng.random() < 0.7 else len(b))] = rng.randrange(256)
        if oracle(bytes(b)) is not None:
            n += 1
            yield bytes(b), "mutated"
    for i in range(2600):
        g = rng.choice(groups)
        g = msgspec.structs.replace(g, seq=10_000 + i)
        lp = g.completions[0].logprobs
        k = i % 13
        if k == 0:
            bad = msgspec.structs.replace(g, schema_version=SCHEMA_VERSION + 1)
        elif k == 1:
            bad = replace_completion(g, logprobs=lp[:-4] + nan)
        elif k == 2:
            bad = replace_completion(g, logprobs=inf + lp[4:])
        elif k == 3:
            bad = replace_completion(g, reward=math.nan)
        elif k == 4:
            bad = replace_completion(g, reward=math.inf)
        elif k == 5:
            bad = replace_completion(g, logprobs=lp[:-4])  # token/logprob length mismatch
        elif k == 6:
            bad = replace_completion(g, versions=g.completions[0].versions + b"\0\0\0\0")
        elif k == 7:
            bad = replace_completion(g, tokens=g.completions[0].tokens[:-1])  # ragged bytes
        elif k == 8:
            bad = msgspec.structs.replace(g, completions=[])
        elif k == 9:
            bad = replace_completion(g, finish_reason="exploded")
        elif k == 10:  # wrong types, written with the generic encoder
            row = msgspec.to_builtins(g)
            row[rng.choice([2, 3, 6, 8])] = rng.choice(["x", -1.5, None, [1, 2], {"a": 1}])
            yield msgspec.msgpack.encode(row), "wrong_type"
            continue
        elif k == 11:
            bad = msgspec.structs.replace(g, actor_id="x" * (MAX_ID_CHARS + 1))
        elif k == 12 and i % 2:  # well-formed, but not for this socket: learner messages, old refs
            yield rng.choice([encode(SampleRequest(i, 4, 0)), encode(Consumed([("fuzz", i)], 0)),
                              msgspec.msgpack.encode(["gref", "fuzz", 10_000 + i, 0, 100, 7]),
                              msgspec.msgpack.encode(["grefs", [["gref", "fuzz", i, 0, 100, 7]]])]), "foreign"
            continue
        else:
            yield encode(Hello("actor", "fuzz", schema_version=SCHEMA_VERSION + 7)), "hello_schema"
            continue
        yield encode(bad), "constructed"
    for _ in range(20):  # above max_frame_bytes, below ZeroMQ's limit: counted
        yield rng.randbytes(MAX_FRAME + rng.randrange(1, ZMQ_SLACK_BYTES)), "oversize"


def test_fuzz_10k_hostile_frames_then_valid_traffic(tmp_path):
    cfg = make_config(run_dir=tmp_path, max_frame_bytes=MAX_FRAME, capacity_groups=100_000)
    rng = random.Random(1234)
    groups = [make_group(ACTOR, i, completions=2, tokens=rng.randrange(1, 40)) for i in range(20)]
    base = [encode(g) for g in groups] + [encode(Hello("actor", ACTOR, token=token(cfg)))]
    oracle = Oracle(cfg)
    frames = list(hostile_frames(rng, base, groups, oracle))
    expected = Counter(oracle(f) for f, _ in frames)
    assert None not in expected and len(frames) >= 10_000
    multipart = 100

    with ServerThread(cfg, str(tmp_path)) as srv:
        ctx = zmq.Context()
        dealer = net.socket(ctx, zmq.DEALER)
        net.connect(dealer, cfg.net.host, cfg.net.buffer_actor_port)
        dec = decoder(BUFFER_TO_ACTOR)
        rejected = Counter()

        def sync():
            """Processing is in order per connection: once our Hello is answered, all before it is.
            (The first one authenticates the connection as ACTOR.)"""
            dealer.send(encode(Hello("actor", ACTOR, token=token(cfg))))
            while True:
                assert dealer.poll(20_000), "server stopped answering"
                msg = dec.decode(dealer.recv())
                for ack in msg.acks if isinstance(msg, Acks) else [msg] if isinstance(msg, Ack) else []:
                    if ack.actor_id == ACTOR and ack.status == "hello":
                        return
                    if ack.status == "rejected":
                        rejected[ack.reason] += 1

        sync()
        for i in range(0, len(frames), BATCH):
            for f, _ in frames[i:i + BATCH]:
                dealer.send(f)
            sync()
        for _ in range(multipart):
            dealer.send_multipart([b"x"] * (MAX_GROUPS_PER_MSG + 1))  # more groups than one message may carry
        sync()
        expected["multipart"] += multipart

        # one frame above ZeroMQ's own limit, on its own connection: dropped by ZeroMQ, not us
        big = net.socket(ctx, zmq.DEALER)
        net.connect(big, cfg.net.host, cfg.net.buffer_actor_port)
        big.send(b"\0" * (MAX_FRAME + ZMQ_SLACK_BYTES + 1024))

        got = Counter({k: v for k, v in srv.invalid.items() if v})
        assert got == expected  # every bad frame counted, under the reason it deserves
        assert srv.store.counters.accepted == 0
        # every refused group whose key was readable got a "rejected" ack with its reason
        assert rejected["length_mismatch"] >= 400 and rejected["nonfinite_logprob"] >= 400
        assert rejected["schema_version"] >= 200 and expected["bad_fields"] >= 50

        # valid traffic afterwards is all accepted and served
        actor, learner = ActorClient(cfg, "after"), LearnerClient(cfg)
        for _ in range(30):
            actor.send(make_group("after", actor.next_seq(), completions=2, tokens=16))
        assert actor.flush(20) and not actor.poll(0)
        keys = []
        while len(keys) < 30:
            b = learner.sample(10, 0, timeout_s=20)
            keys += [g.key for g in b.groups]
            learner.consumed([g.key for g in b.groups], 0)
        assert sorted(keys) == [("after", i) for i in range(30)]
        assert srv.stats()["buffer/dropped_invalid"] == sum(expected.values())
        assert srv.store.invariant_ok()
        for c in (actor, learner):
            c.close()
        big.close()
        dealer.close()
        ctx.term()
