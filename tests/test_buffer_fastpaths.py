"""The buffer's fast paths against the plain reference code they replaced: vectorised
``validate_group`` and ``entry_from_group``, the learner's multipart batch, and the actor
client's O(1) send bookkeeping (resends and the window still hold)."""

import math
import threading

import msgspec
import numpy as np
import zmq

from buffer.client import ActorClient, LearnerClient
from buffer.store import entry_from_group
from buffer.synth import make_group
from buffer.testing import ServerThread, make_config
from core import net
from core.messages import (ACTOR_TO_BUFFER, BUFFER_TO_LEARNER, LOGPROB_DTYPE, SCHEMA_VERSION,
                           TOKEN_DTYPE, VERSION_DTYPE, Ack, Hello, InvalidMessage, RolloutGroup,
                           SampleBatch, SampleRequest, decoder, encode, make_completion, validate_group)


def reference_validate(g):
    """validate_group as it was before vectorisation: one completion at a time."""
    if g.schema_version != SCHEMA_VERSION:
        raise InvalidMessage("schema_version")
    if not g.completions:
        raise InvalidMessage("empty_group")
    if g.seq < 0 or g.start_version < 0:
        raise InvalidMessage("negative_id")
    if len(g.prompt_tokens) % TOKEN_DTYPE.itemsize:
        raise InvalidMessage("ragged_bytes")
    for c in g.completions:
        n_tok, r1 = divmod(len(c.tokens), TOKEN_DTYPE.itemsize)
        n_lp, r2 = divmod(len(c.logprobs), LOGPROB_DTYPE.itemsize)
        n_ver, r3 = divmod(len(c.versions), VERSION_DTYPE.itemsize)
        if r1 or r2 or r3:
            raise InvalidMessage("ragged_bytes")
        if not (n_tok == n_lp == n_ver):
            raise InvalidMessage("length_mismatch")
        if not math.isfinite(c.reward):
            raise InvalidMessage("nonfinite_reward")
        if n_tok:
            lp = np.frombuffer(c.logprobs, LOGPROB_DTYPE)
            if not np.isfinite(lp).all():
                raise InvalidMessage("nonfinite_logprob")
            if (lp > 1e-4).any():
                raise InvalidMessage("positive_logprob")
            if (np.frombuffer(c.versions, VERSION_DTYPE) < 0).any():
                raise InvalidMessage("negative_version")
        if c.finish_reason not in ("stop", "length"):
            raise InvalidMessage("finish_reason")


def reason_of(fn, g):
    try:
        fn(g)
    except InvalidMessage as e:
        return e.reason
    return None


def corrupt(g, rng):
    """One or two random defects of the kinds validate_group looks for, in random completions."""
    comps = list(g.completions)
    for _ in range(int(rng.integers(1, 3))):
        if not comps:
            break
        i = int(rng.integers(len(comps)))
        c = comps[i]
        kind = int(rng.integers(10))
        if kind in (0, 1, 2) and (len(c.logprobs) % 4 or len(c.versions) % 4):
            continue  # already ragged by the first defect
        lp = np.frombuffer(c.logprobs[: len(c.logprobs) // 4 * 4], LOGPROB_DTYPE).copy()
        ver = np.frombuffer(c.versions[: len(c.versions) // 4 * 4], VERSION_DTYPE).copy()
        j = int(rng.integers(max(1, lp.size)))
        if kind == 0 and lp.size:
            lp[j] = rng.choice([np.nan, np.inf, -np.inf])
        elif kind == 1 and lp.size:
            lp[j] = rng.choice([0.5, 1e-3, 1e-4, 0.0, 2e-4])  # around the 1e-4 tolerance
        elif kind == 2 and ver.size:
            ver[j] = -1
        elif kind == 3:
            c = msgspec.structs.replace(c, reward=float(rng.choice([np.nan, np.inf, -np.inf])))
        elif kind == 4:
            c = msgspec.structs.replace(c, finish_reason=str(rng.choice(["", "eos", "Stop"])))
        elif kind == 5:
            c = msgspec.structs.replace(c, tokens=c.tokens[:-4])
        elif kind == 6:
            c = msgspec.structs.replace(c, versions=c.versions + b"\0")
        elif kind == 7:
            c = make_completion([], [], [], "stop", 0.0)  # empty completions are valid
        elif kind == 8:
            comps = []
            break
        else:
            c = msgspec.structs.replace(c, logprobs=c.logprobs[:-4])
        if kind in (0, 1, 2):
            c = msgspec.structs.replace(c, logprobs=lp.tobytes(), versions=ver.tobytes())
        comps[i] = c
    return msgspec.structs.replace(g, completions=comps)


def test_vectorised_validate_group_gives_the_reference_verdict_and_reason():
    rng = np.random.default_rng(0)
    seen = set()
    for n in range(600):
        g = make_group("a", n, completions=int(rng.integers(1, 5)), tokens=int(rng.integers(1, 40)),
                       rng=rng, ragged=bool(n % 2))
        if n % 6:  # mostly broken ones; some valid
            g = corrupt(g, rng)
        want = reason_of(reference_validate, g)
        assert reason_of(validate_group, g) == want, g
        seen.add(want)
    # the sample exercised every completion-level reason and the valid case
    assert {None, "empty_group", "ragged_bytes", "length_mismatch", "nonfinite_reward", "nonfinite_logprob",
            "positive_logprob", "negative_version", "finish_reason"} <= seen


def test_all_empty_completions_are_valid_and_keep_the_start_version():
    g = make_group("a", 0, completions=2, tokens=4, version=3)
    g = msgspec.structs.replace(g, completions=[make_completion([], [], [], "stop", 0.0)] * 2)
    validate_group(g)
    e = entry_from_group(g, b"xx")
    assert (e.min_version, e.length, e.nbytes) == (g.min_version(), 0, 2) == (3, 0, 2)


def test_entry_from_group_matches_the_per_completion_definitions():
    rng = np.random.default_rng(1)
    for n in range(50):
        g = make_group("a", n, completions=int(rng.integers(1, 6)), tokens=int(rng.integers(1, 64)),
                       version=int(rng.integers(0, 5)), rng=rng)
        e = entry_from_group(g)
        assert e.min_version == g.min_version()
        assert e.length == max(c.num_tokens for c in g.completions)
        assert e.nbytes == g.nbytes()


def test_learner_receives_the_actor_bytes_and_reassembles_a_sample_batch(tmp_path):
    cfg = make_config()
    sent = [make_group("a0", i, completions=2, tokens=16) for i in range(3)]
    with ServerThread(cfg, str(tmp_path)):
        actor = ActorClient(cfg, "a0")
        for g in sent:
            actor.send(g)
        assert actor.flush(10)
        ctx = zmq.Context()
        raw = net.socket(ctx, zmq.DEALER)
        net.connect(raw, "127.0.0.1", cfg.net.buffer_learner_port)
        raw.send(encode(Hello("learner", "raw")))
        raw.send(encode(SampleRequest(1, 2, 0)))
        assert raw.poll(5000)
        frames = raw.recv_multipart()
        head = decoder(BUFFER_TO_LEARNER).decode(frames[0])
        assert isinstance(head, SampleBatch) and head.request_id == 1 and head.groups == []
        assert frames[1:] == [encode(g) for g in sent[:2]]  # byte for byte what the actor sent
        raw.close()
        ctx.term()
        learner = LearnerClient(cfg)
        batch = learner.sample(1, 0, timeout_s=5)
        assert isinstance(batch, SampleBatch) and batch.groups == [sent[2]]
        assert isinstance(batch.groups[0], RolloutGroup)
        learner.close()
        actor.close()


class SilentBuffer:
    """Answers the Hello, records every group frame, acks only once told to."""

    def __init__(self, cfg):
        self.ctx = zmq.Context()
        self.sock = net.socket(self.ctx, zmq.ROUTER)
        net.bind(self.sock, "127.0.0.1", cfg.net.buffer_actor_port)
        self.dec = decoder(ACTOR_TO_BUFFER)
        self.arrivals: list[int] = []
        self.ack_from = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        unacked = []
        while not self.stop.is_set():
            if self.sock.poll(20):
                ident, frame = self.sock.recv_multipart()
                msg = self.dec.decode(frame)
                if isinstance(msg, Hello):
                    self.sock.send_multipart([ident, encode(Ack(msg.id, 0, "hello"))])
                    continue
                self.arrivals.append(msg.seq)
                unacked.append((ident, msg))
            if self.ack_from.is_set():
                for ident, msg in unacked:
                    self.sock.send_multipart([ident, encode(Ack(msg.actor_id, msg.seq, "ok"))])
                unacked.clear()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def test_actor_client_resends_unacked_groups_and_keeps_to_its_window(tmp_path):
    cfg = make_config()
    buf = SilentBuffer(cfg)
    actor = ActorClient(cfg, "a0", window=3, resend_s=0.2)
    try:
        for _ in range(3):  # fills the window without blocking
            actor.send(make_group("a0", actor.next_seq(), completions=1, tokens=4))
        assert not actor.flush(0.7)  # nothing acked: every group is resent every 0.2 s
        assert sorted(set(buf.arrivals)) == [0, 1, 2]
        assert all(buf.arrivals.count(s) >= 2 for s in range(3))
        buf.ack_from.set()
        actor.send(make_group("a0", actor.next_seq(), completions=1, tokens=4))  # waited for room
        assert actor.flush(5) and actor.outstanding == 0
        first_3 = buf.arrivals.index(3)
        assert first_3 > buf.arrivals.index(2)  # seq 3 only went out once the window had room
    finally:
        actor.close()
        buf.close()
