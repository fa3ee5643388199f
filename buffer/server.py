"""The replay-buffer process: two ROUTER sockets (actors, learner) around a :class:`buffer.store.Store`
and its durable copy (:mod:`buffer.durable`). Group bytes stay the actor's frame: stored and
forwarded, never re-encoded; an actor message carries up to ``MAX_GROUPS_PER_MSG``, each judged
alone. One loop turn: learner messages first (its round trip paces the pipeline), a bounded batch
of actor messages, one commit, then every reply that depends on it.
Nothing a peer sends can stop the loop: whatever is refused is counted in
``buffer/dropped_invalid/<reason>``. A group newer than the learner's version + 1 is rejected
(``future_version``): v + 1 may be published before the learner's next request says so. A learner's
claimed version is believed up to ``MAX_VERSION_LEAD`` above the buffer's own record (kept in the
store: what learners' Hellos and trained steps showed), so no peer can make every group stale.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from buffer import policies
from buffer.durable import CorruptStore, DurableStore, StoreWriteFailed
from buffer.store import Entry, Store, entry_from_group
from core import config as C
from core import heartbeat, net
from core.files import atomic_write
from core.funnel import length_bucket
from core.proc import EXIT_CORRUPT_LOG, EXIT_WRITE_FAILED
from core.messages import (LEARNER_TO_BUFFER, MAX_GROUPS_PER_MSG, SCHEMA_VERSION, Ack, Acks, Consumed,
                           Control, Hello, InFlight, InvalidMessage, Limits, RolloutGroup, SampleBatch,
                           SampleRequest, decode_reason, decoder, encode, group_decoder, group_key, validate_groups)

log = logging.getLogger("driftrl.buffer")

# ZeroMQ drops (and disconnects) frames above max_frame_bytes + this; between the two the
# frame is received and counted as "oversize", so hostile traffic stays visible in the metrics
ZMQ_SLACK_BYTES = 64 << 10
# actor messages per loop turn: acks keep flowing under a flood and the learner is served at least
# once per turn; with group commit, an fsync covers whatever arrived meanwhile
MAX_BATCH_MSGS = 8
# learner messages are small: more of them per turn lets the learner's own through a stranger's
# flood of the learner port (ZeroMQ reads the peers in turn), while the actors still get theirs
MAX_BATCH_MSGS_LEARNER = 64
MAX_DRAIN_ON_CLOSE = 4096  # learner-port messages read before a closed learner's leases go back
MAX_BATCH_BYTES = 4 << 20
MAX_ID_CHARS = 128
MAX_VERSION = 2**31 - 1  # a token's version is an int32: a learner claiming more is refused
# a resumed learner publishes above every version it published, and its last steps' marks may not
# have been committed (LAZY_COMMIT_S): that far above the record a claim is still believed
MAX_VERSION_LEAD = 16
MAX_ACTORS = 4096  # authenticated actor connections remembered (each actor id keeps only its latest)
METRICS_EVERY_S = 1.0
# an idle turn's period: arrivals and a signal (its wakeup fd) end the poll at once; on a 2-core VM a
# wake-up costs ~0.1 ms of CPU, and ten a second were a tenth of the buffer's CPU per learner step
POLL_MS = int(METRICS_EVERY_S * 1000)
# ZMTP heartbeats on the learner port: a learner host that vanishes without closing its TCP
# connection is disconnected (and its leases released) after this long without an answer
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 20000


@dataclass
class _Learner:
    ident: bytes
    fd: int  # the connection it authenticated on
    name: str  # lessee name: unique per incarnation
    pending: SampleRequest | None = None
    answered: int = -1  # last request id served (resends of it are ignored)
    version: int | None = None  # latest version this incarnation reported
    # its Hello's version, then that of each step it reported trained: what outlives it
    record: int = -1


class BufferServer:
    def __init__(self, cfg: C.Config, run_dir: str, metrics: Callable[[dict], None] | None = None,
                 ctx: zmq.Context | None = None):
        b = cfg.buffer
        self.metrics = metrics
        self.max_frame = b.max_frame_bytes
        self.limits = Limits.of(cfg)
        self.store = Store(b.capacity_groups, b.capacity_bytes, b.max_staleness, b.policy)
        self.invalid: Counter = Counter()
        self.rolled_back = 0  # groups served again after a learner restart, every token of which was newer
        self.send_failed = 0
        self.deferred = 0  # groups answered busy until the learner reports its version
        self.leases_expired = 0  # groups released because the learner's connection dropped
        self.paused = False  # the learner asked the actors to start no new group
        self._control: Control | None = None  # set once the learner's limit or pause departs from the config
        self.stale_wait = policies.StaleWait(b.stale_wait_s) if b.stale_strategy == "wait" else None
        self.token = _load_token(run_dir, cfg.net.host)
        self.run_dir = run_dir  # for the heartbeat (core/heartbeat.py)
        self._actor_dec = group_decoder(self.limits, Hello, InFlight)
        self._learner_dec = decoder(LEARNER_TO_BUFFER)
        self._hello_dec = decoder(Hello)
        self._group_dec = decoder(RolloutGroup)
        self._actor_of: dict[bytes, tuple[str, int]] = {}  # identity -> (actor id, fd) it authenticated
        self._actor_ident: dict[str, bytes] = {}  # actor id -> its identity, for late acks
        self._learner: _Learner | None = None
        self._last_version: int | None = None  # of the learner that disconnected last
        self._record = -1  # the newest version a learner showed (durable; -1: none yet)
        self._incarnations = 0
        self._outbox: dict[str, deque[list]] = {"actor": deque(), "learner": deque()}  # sent after the commit
        self._arrived: list[tuple] = []  # (ident, actor, group, frame) of the message being read
        self._covered = -1  # the learner's covered_step (SampleRequest)
        self._next_metrics = 0.0
        self._invariant_reported = False
        self._own_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        self.actor_sock = self.learner_sock = self._monitor = None
        self._auth = None
        self.db: DurableStore | None = None
        try:
            self._bind(cfg.net)
            self.db = DurableStore(os.path.join(run_dir, "buffer") if b.persist else None, b.fsync)
            self._recover()
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        for sock in (self.actor_sock, self.learner_sock, self._monitor):
            self._poller.register(sock, zmq.POLLIN)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller.register(self._wake_r, zmq.POLLIN)
        log.info("buffer listening on %s: actors :%d, learner :%d; %d groups recovered",
                 cfg.net.host, self.actor_port, self.learner_port, self.store.counters.recovered)

    @property
    def learner_version(self) -> int | None:
        """The latest version the current learner incarnation reported (None: none yet); with no
        learner connected, the last one's (it still bounds what the actors may send)."""
        return self._learner.version if self._learner is not None else self._last_version

    def _bind(self, n) -> None:
        curve, self._auth = net.serve_curve(self.ctx, n)
        cap = self.max_frame + ZMQ_SLACK_BYTES
        self.actor_sock = net.socket(self.ctx, zmq.ROUTER, max_msg=cap)
        self.learner_sock = net.socket(self.ctx, zmq.ROUTER, max_msg=cap)
        for s in (self.actor_sock, self.learner_sock):
            # a client reconnecting under its fixed identity takes over from its stale session
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.learner_sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.learner_sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = self.learner_sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.actor_port = net.bind(self.actor_sock, n.host, n.buffer_actor_port, curve)
        self.learner_port = net.bind(self.learner_sock, n.host, n.buffer_learner_port, curve)

    def _recover(self) -> None:
        self._record = self.db.record()
        raws, keys = self.db.load()
        for key in keys:
            self.store.seen.add(tuple(key))
        for raw in raws:
            self.store.restore(entry_from_group(self._group_dec.decode(raw), raw))

    # ---- the loop ----------------------------------------------------------------------------

    def serve_forever(self, stop_event=None, poll_ms: int = POLL_MS) -> None:
        """Until ``stop_event``. In the main thread a signal (which sets it) ends the poll at once,
        through its wakeup fd; elsewhere the event is noticed within ``poll_ms``."""
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.set_wakeup_fd(self._wake_w)
        try:
            while stop_event is None or not stop_event.is_set():
                self.step(poll_ms)
        finally:
            if main:
                signal.set_wakeup_fd(-1)
            self.close()

    def step(self, timeout_ms: int = POLL_MS) -> None:
        """One loop turn (public so tests can drive the server without a thread)."""
        ready = dict(self._poller.poll(timeout_ms))
        if self.learner_sock in ready:  # first: the learner's round trip paces the pipeline
            self._drain(self.learner_sock, self._on_learner, MAX_BATCH_MSGS_LEARNER)
            self._serve_requests()
            self._flush_outbox()
        if self._monitor in ready:
            self._on_monitor()
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        if self.actor_sock in ready:
            self._drain(self.actor_sock, self._on_actor, max_parts=MAX_GROUPS_PER_MSG, after=self._admit)
            self._serve_requests()
        if self.stale_wait is not None and not ready:  # an idle turn: a wait may have timed out
            self._serve_requests()
        self._flush_outbox()
        now = time.monotonic()
        if now >= self._next_metrics:
            self._next_metrics = now + METRICS_EVERY_S
            self._report()
        heartbeat.beat(self.run_dir, "buffer")  # every turn (<= POLL_MS): the launcher's hung-role check

    def _drain(self, sock: zmq.Socket, handle, max_msgs: int = MAX_BATCH_MSGS, max_parts: int = 1,
               after=None) -> None:
        """Up to ``max_msgs`` messages, each of 1..``max_parts`` payload frames handled in order, then ``after()``."""
        nbytes = 0
        for _ in range(max_msgs):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            if not 2 <= len(frames) <= max_parts + 1:
                self.invalid["multipart"] += 1
                continue
            try:  # a ZMTP/1.0 peer's (no greeting) messages have no source: it can never say Hello
                fd = frames[1].get(zmq.SRCFD)
            except zmq.ZMQError:
                self.invalid["legacy_peer"] += 1
                continue
            for payload in frames[1:]:  # zmq.Frames: decoded, stored and forwarded without a copy
                nbytes += len(payload)
                if len(payload) > self.max_frame:
                    self.invalid["oversize"] += 1
                    continue
                handle(ident, fd, payload)
            if after is not None:
                after()
            if nbytes >= MAX_BATCH_BYTES:
                return

    # ---- who is speaking ---------------------------------------------------------------------

    def _hello_refusal(self, msg: Hello, role: str) -> str | None:
        """Why a Hello does not authenticate its connection (None: it does)."""
        if msg.schema_version != SCHEMA_VERSION:
            return "schema_version"
        if len(msg.id) > MAX_ID_CHARS:
            return "bad_actor_id" if role == "actor" else "bad_id"
        if msg.role != role:
            return "bad_role"
        if role == "learner" and (msg.step < -1 or not (0 if msg.step >= 0 else -1) <= msg.version <= MAX_VERSION):
            return "bad_hello"  # a learner's weights: none (-1, -1), or a step and its version >= 0
        if self.token is not None and not hmac.compare_digest(msg.token.encode(), self.token.encode()):
            return "bad_token"
        return None

    def _stranger_hello(self, data) -> Hello | None:
        """A Hello from a connection not authenticated yet, or None (counted, answered by caller)."""
        try:
            return self._hello_dec.decode(data)
        except Exception:  # noqa: BLE001 -- any frame that is not a Hello: nothing of it is used
            self.invalid["unauthenticated"] += 1
            return None

    # ---- actors ------------------------------------------------------------------------------

    def _on_actor(self, ident: bytes, fd: int, data) -> None:
        """A group waits for the rest of its message (:meth:`_admit`); anything else is handled once
        the groups before it are, so every answer reflects what arrived before it."""
        peer = self._actor_of.get(ident)
        if peer is None or peer[1] != fd:
            self._admit()
            self._on_actor_stranger(ident, fd, data)
            return
        msg = self._decode(self._actor_dec, data, ident, actor=True)
        if isinstance(msg, RolloutGroup):
            self._arrived.append((ident, peer[0], msg, data))
            return
        self._admit()
        if isinstance(msg, InFlight):
            self._on_in_flight(peer[0], msg.oldest)
        elif isinstance(msg, Hello):
            self._on_actor_hello(ident, fd, msg)

    def _on_actor_stranger(self, ident: bytes, fd: int, data) -> None:
        msg = self._stranger_hello(data)
        if msg is not None:
            self._on_actor_hello(ident, fd, msg)
            return
        key = group_key(data)
        if key is not None and len(key[0]) <= MAX_ID_CHARS:  # its client says Hello and resends
            self._ack(ident, Ack(key[0], key[1], "unauthenticated"))

    def _on_actor_hello(self, ident: bytes, fd: int, msg: Hello) -> None:
        reason = self._hello_refusal(msg, "actor")
        if reason is None and ident not in self._actor_of and len(self._actor_of) >= MAX_ACTORS:
            reason = "too_many_actors"
        if reason is not None:
            self.invalid[reason] += 1
            self._ack(ident, Ack(msg.id[:MAX_ID_CHARS], -1, "rejected", reason))
            return
        prev = self._actor_of.get(ident)
        if prev is not None and self._actor_ident.get(prev[0]) == ident:
            del self._actor_ident[prev[0]]
        old = self._actor_ident.get(msg.id)
        if old is not None and old != ident:  # a restarted actor takes its id over
            self._actor_of.pop(old, None)
        self._actor_of[ident] = (msg.id, fd)
        self._actor_ident[msg.id] = ident
        if self.stale_wait is not None:
            self.stale_wait.report(msg.id, -1)  # a new incarnation reports its own
        # tells an actor that lost its local counter where its seq numbering resumes
        self._ack(ident, Ack(msg.id, self.store.seen.next_seq(msg.id), "hello"))
        if self._control is not None:
            self._ack(ident, self._control)

    def _admit(self) -> None:
        """The groups that arrived together, validated together (one numpy pass), each judged alone."""
        arrived, self._arrived = self._arrived, []
        for group, verdict in zip(arrived, validate_groups([g for _, _, g, _ in arrived], self.limits)):
            self._on_group(*group, verdict)

    def _on_group(self, ident: bytes, actor: str, g: RolloutGroup, raw, verdict) -> None:
        try:
            if len(g.actor_id) > MAX_ID_CHARS:
                raise InvalidMessage("bad_actor_id")
            if isinstance(verdict, InvalidMessage):
                raise verdict
            min_version, newest = verdict
            if g.actor_id != actor:
                raise InvalidMessage("wrong_peer", f"{g.actor_id!r} from the connection of {actor!r}")
            defer = self._too_new(newest)
        except InvalidMessage as e:
            self.invalid[e.reason] += 1
            self.store.reject(g.length(), "invalid")
            self._ack(ident, Ack(g.actor_id[:MAX_ID_CHARS], g.seq, "rejected", e.reason))
            return
        if defer:
            self.deferred += 1
            self._ack(ident, Ack(g.actor_id, g.seq, "busy", "version_unknown"))
            return
        entry = entry_from_group(g, raw, min_version)
        status, reason = self.store.offer(entry, self.learner_version)
        if status == "ok":
            self.db.add(entry.key, raw)
        self._ack(ident, Ack(g.actor_id, g.seq, status, reason))

    def _on_in_flight(self, actor: str, oldest: int) -> None:
        if oldest > MAX_VERSION:
            self.invalid["version_out_of_range"] += 1
        elif self.stale_wait is not None:
            self.stale_wait.report(actor, oldest)

    def _too_new(self, newest: int) -> bool:
        """True when a group's newest version is above the bound while no learner version is known
        (answer busy); raises ``future_version`` when it is above a known one's (module docstring)."""
        known = self.learner_version
        if newest <= (known or 0) + 1:
            return False
        if known is None:
            return True
        raise InvalidMessage("future_version", f"version {newest} > learner version {known} + 1")

    def _ack(self, ident: bytes, ack: Ack | Control) -> None:
        self._outbox["actor"].append([ident, ack])  # encoded when sent: see _flush_outbox

    # ---- learners ----------------------------------------------------------------------------

    def _on_learner(self, ident: bytes, fd: int, data) -> None:
        st = self._learner
        if st is None or st.ident != ident or st.fd != fd:
            msg = self._stranger_hello(data)
            if msg is not None:
                self._on_learner_hello(ident, fd, msg)
            else:
                self._tell_learner(ident, Ack("", -1, "unauthenticated"))
            return
        msg = self._decode(self._learner_dec, data, ident, actor=False)
        if isinstance(msg, SampleRequest):
            self._on_request(st, msg)
        elif isinstance(msg, Consumed):
            self._on_consumed(st, msg)
        elif isinstance(msg, Hello) and self._hello_refusal(msg, "learner") is not None:
            self._on_learner_hello(ident, fd, msg)  # counted and answered
        # a good Hello on the learner's own connection (it was told "unauthenticated" for a
        # message sent before its first Hello got through) changes nothing: same incarnation

    def _on_learner_hello(self, ident: bytes, fd: int, msg: Hello) -> None:
        reason = self._hello_refusal(msg, "learner")
        if reason is not None:
            self.invalid[reason] += 1
            self._tell_learner(ident, Ack("", -1, "rejected", reason))
            return
        # a (re)started learner: whatever the previous one held but never consumed was not
        # trained on, so it is available again
        self._drop_learner("replaced by a new learner connection")
        self._incarnations += 1
        if self._record < 0:  # the first learner's Hello is the record there is
            self._raise_record(max(msg.version, 0))
        self._learner = _Learner(ident, fd, f"{msg.id}#{self._incarnations}", record=self._bounded(msg.version))
        log.info("learner %s connected at step %d", msg.id, msg.step)
        if msg.step >= 0:
            self._requeue(msg.step, msg.version)

    def _requeue(self, step: int, version: int) -> None:
        """Serve again what the learner trained after ``step``; drop the groups every token of which
        is newer than ``version``: they were sampled by weights that no longer exist."""
        entries = [entry_from_group(self._group_dec.decode(raw), raw) for raw in self.db.requeue(step)]
        gone = [e for e in entries if e.min_version > version]
        self.db.done([e.key for e in gone])
        self.rolled_back += len(gone)
        self.store.counters.lost_by_len.update(length_bucket(e.length) for e in gone)
        for e in entries:
            if e.min_version <= version:
                self.store.restore(e)
        if entries:
            log.info("%d groups trained after step %d served again, %d dropped as rolled back",
                     len(entries) - len(gone), step, len(gone))

    def _drop_learner(self, why: str) -> int:
        st, self._learner = self._learner, None
        if st is None:
            return 0
        self._last_version = st.record if st.record >= 0 else self._last_version
        released = self.store.release(st.name)
        if released:
            log.info("learner %s %s: %d leased groups released", st.name, why, released)
        return released

    def _on_monitor(self) -> None:
        """The learner's connection closed: its leases go back, once what it sent before (its Consumed) is read."""
        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            st = self._learner
            if ev["event"] == zmq.EVENT_DISCONNECTED and st is not None and ev["value"] == st.fd:
                self._drain(self.learner_sock, self._on_learner, MAX_DRAIN_ON_CLOSE)
                if self._learner is st:  # (not replaced meanwhile by a new learner's Hello)
                    self.leases_expired += self._drop_learner("disconnected")

    def _version_ok(self, st: _Learner, version: int) -> bool:
        """A learner incarnation's versions never go down (a new Hello may start anywhere) and fit an int32."""
        if st.version is not None and version < st.version:
            self.invalid["version_regressed"] += 1
            return False
        if version > MAX_VERSION:
            self.invalid["version_out_of_range"] += 1
            return False
        st.version = self._bounded(version)
        return True

    def _bounded(self, version: int) -> int:
        """``version``, or the most the record lets a learner claim (counted ``version_ahead``)."""
        if self._record < 0 or version <= self._record + MAX_VERSION_LEAD:
            return version
        self.invalid["version_ahead"] += 1
        return self._record + MAX_VERSION_LEAD

    def _raise_record(self, version: int) -> None:
        if version > self._record:
            self._record = version
            self.db.set_record(version)

    def _on_request(self, st: _Learner, msg: SampleRequest) -> None:
        if msg.num_groups < 1 or msg.learner_version < 0 or msg.max_staleness < -1:
            self.invalid["bad_request"] += 1
        elif self._version_ok(st, msg.learner_version):
            self._follow(msg)
            if msg.covered_step > self._covered:
                self._covered = msg.covered_step
                self.db.covered(msg.covered_step)
            if msg.request_id > st.answered:
                st.pending = msg  # else: a resend of one already answered

    def _follow(self, msg: SampleRequest) -> None:
        """The learner's limit and pause; a change reaches every actor as a Control."""
        limit = msg.max_staleness if msg.max_staleness >= 0 else self.store.max_staleness
        changes = [f"max_staleness {self.store.max_staleness} -> {limit}"] if limit != self.store.max_staleness else []
        if msg.pause_actors != self.paused:
            changes.append("actors paused" if msg.pause_actors else "actors running")
        if not changes:
            return
        log.info("learner control: %s", ", ".join(changes))
        self.store.max_staleness, self.paused = limit, msg.pause_actors
        self._control = Control(limit, msg.pause_actors)
        for ident in self._actor_ident.values():
            self._ack(ident, self._control)

    def _on_consumed(self, st: _Learner, msg: Consumed) -> None:
        if not self._version_ok(st, msg.learner_version):
            return
        done = self.store.consume(msg.keys, st.name)
        self.db.trained([e.key for e in done], msg.step)
        if done and msg.step >= 0:  # a step trained on groups this buffer served: evidence
            st.record = max(st.record, st.version)
            self._raise_record(st.record)

    def _tell_learner(self, ident: bytes, ack: Ack) -> None:
        self._outbox["learner"].append([ident, encode(ack)])

    def _serve_requests(self) -> None:
        st, store = self._learner, self.store
        req = st.pending if st is not None else None
        if req is None:
            return
        if self.stale_wait is not None and not store.saturated and \
                self.stale_wait.holds(req.request_id, st.version - store.max_staleness, time.monotonic()):
            return  # stale_strategy = wait, and there is room for the groups waited for
        n = min(req.num_groups, store.capacity_groups)
        avail = store.available()
        # full buffer: serve what there is rather than wait for groups that cannot fit
        partial = store.saturated and avail > 0
        if avail < n and not partial:
            return
        taken, drops = store.take(n, st.version, lessee=st.name, at_least=1 if partial else n)
        self._dropped(drops)
        if not taken:
            return
        st.pending, st.answered = None, req.request_id
        head = encode(SampleBatch(req.request_id, [], len(store.resident)))
        self._outbox["learner"].append([st.ident, head, *[e.raw for e in taken]])

    def _dropped(self, drops: list[Entry]) -> None:
        if not drops:
            return
        self.db.done([e.key for e in drops])
        for e in drops:
            ident = self._actor_ident.get(e.key[0])
            if ident is not None:  # lets the actor give back its admission quota
                self._ack(ident, Ack(e.key[0], e.key[1], "dropped", "stale"))

    # ---- plumbing ----------------------------------------------------------------------------

    def _decode(self, dec, data, ident: bytes, actor: bool):
        try:
            return dec.decode(data)
        except Exception as e:  # noqa: BLE001 -- msgspec's DecodeError / ValidationError
            reason = decode_reason(e)
        self.invalid[reason] += 1
        key = group_key(data) if actor else None
        if key is not None and len(key[0]) <= MAX_ID_CHARS:
            self._ack(ident, Ack(key[0], key[1], "rejected", reason))
        return None

    def _flush_outbox(self) -> None:
        """Commit, then send every queued message (in order per socket)."""
        self.db.commit()
        out = self._outbox["actor"]
        ready: dict[bytes, list[Ack]] = {}  # per actor, in order: one message for all its acks
        while out:
            ident, msg = out.popleft()
            if isinstance(msg, Control):
                self._send(self.actor_sock, [ident, encode(msg)])
            else:
                ready.setdefault(ident, []).append(msg)
        for ident, acks in ready.items():
            self._send(self.actor_sock, [ident, encode(acks[0] if len(acks) == 1 else Acks(acks))])
        out = self._outbox["learner"]
        while out:
            self._send(self.learner_sock, out.popleft())

    def _send(self, sock: zmq.Socket, frames: list) -> None:
        """One multipart message; big frames (groups) go zero-copy, small ones are copied (cheaper)."""
        try:
            net.send_frames(sock, frames)
        except zmq.ZMQError:  # peer gone or its queue full: it resends / re-requests
            self.send_failed += 1

    def stats(self) -> dict[str, float]:
        out = self.store.stats()
        out["buffer/dropped_invalid"] = float(sum(self.invalid.values()))
        out["buffer/send_failed"] = float(self.send_failed)  # peers gone or not reading
        out["buffer/deferred_future"] = float(self.deferred)
        out["buffer/leases_expired"] = float(self.leases_expired)
        w = self.stale_wait
        out["buffer/stale_waits"] = float(w.held if w else 0)  # requests held by stale_strategy = wait
        out["buffer/stale_wait_timeouts"] = float(w.timeouts if w else 0)
        out["buffer/max_staleness"] = float(self.store.max_staleness)
        out["buffer/actors_paused"] = float(self.paused)
        for reason, n in self.invalid.items():
            out[f"buffer/dropped_invalid/{reason}"] = float(n)
        out["buffer/dropped_rolled_back"] = out["funnel/rolled_back"] = float(self.rolled_back)
        out["buffer/disk_bytes"] = float(self.db.disk_bytes())
        return out

    def _report(self) -> None:
        values = self.stats()
        if values["buffer/invariant_ok"] != 1.0 and not self._invariant_reported:
            self._invariant_reported = True
            log.error("accounting invariant broken: %s", self.store.counters)
        if self.metrics is not None:
            self.metrics(values)

    def close(self) -> None:
        if self.actor_sock is not None and self.store.counters.accepted:
            c = self.store.counters
            log.info("buffer closing: accepted %d, consumed %d, dropped %s, resident %d, duplicates %d, "
                     "busy %d, invalid %d", c.accepted, c.consumed, dict(c.dropped), len(self.store.resident),
                     c.duplicates, c.busy, sum(self.invalid.values()))
            self._report()  # the final figures reach the metrics too, not only the last second's
        if self.db is not None:
            self.db.close()
            self.db = None
        if self._monitor is not None:
            self.learner_sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        for s in (self.actor_sock, self.learner_sock):
            if s is not None:
                s.close(linger=0)
        self.actor_sock = self.learner_sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()
        for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None


def _load_token(run_dir: str, host: str) -> str | None:
    """The run's secret; None (any Hello accepted) only on loopback with no secret file."""
    if os.path.exists(os.path.join(run_dir, net.SECRET_FILE)):
        return net.run_secret(run_dir)
    if not net.is_loopback(host):
        raise net.InsecureBindError(f"refusing to serve {host} without the run secret "
                                    f"{os.path.join(run_dir, net.SECRET_FILE)} (core.net.create_run_secret)")
    log.warning("no run secret in %s: accepting any Hello (loopback only)", run_dir)
    return None


def main(argv=None) -> None:
    from core.proc import die_with_parent, setup_logging, stop_event

    ap = argparse.ArgumentParser(description="driftrl replay buffer")
    ap.add_argument("--config", required=True, help="RUN_DIR/config.json")
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    die_with_parent()
    setup_logging("buffer")
    stop = stop_event()
    with open(args.config, "rb") as f:
        cfg = C.from_json(f.read())
    from core.metrics import MetricsWriter

    sink = MetricsWriter(args.run_dir, "buffer", "buffer")  # run_dir/metrics/buffer-buffer.jsonl
    server = None

    def emit(values: dict) -> None:
        sink.emit(server.learner_version or 0, values)

    try:
        server = BufferServer(cfg, args.run_dir, metrics=emit)
        ports = {"actor": server.actor_port, "learner": server.learner_port, "pid": os.getpid()}
        os.makedirs(os.path.join(args.run_dir, "buffer"), exist_ok=True)  # bound ports (the config may say 0)
        atomic_write(os.path.join(args.run_dir, "buffer", "ports.json"), json.dumps(ports).encode(), durable=False)
        server.serve_forever(stop)
    except CorruptStore as e:  # one clear line: restarting cannot help, the repair it names can
        log.error("%s", e)
        sys.exit(EXIT_CORRUPT_LOG)
    except StoreWriteFailed as e:  # a full disk: restarting cannot help until there is space
        log.error("%s (exit %d)", e, EXIT_WRITE_FAILED)
        sys.exit(EXIT_WRITE_FAILED)
    finally:
        sink.close()
        log.info("buffer stopped")


if __name__ == "__main__":
    main()
