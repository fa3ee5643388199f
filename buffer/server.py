"""The replay-buffer process: two ROUTER sockets around a :class:`buffer.store.Store`.

Actor port (DEALERs): ``Hello`` -> ``Ack(status="hello", seq=next unused seq)``;
``RolloutGroup`` -> ``Ack`` ok | duplicate | busy | rejected(reason); later, an accepted group
dropped as stale -> ``Ack(status="dropped", reason="stale")`` to its actor's last identity.
Learner port (DEALERs): ``SampleRequest`` is held until ``num_groups`` fresh groups exist, then
answered with a ``SampleBatch`` whose groups are leased to that learner; ``Consumed`` retires
them; a learner ``Hello`` releases what an earlier incarnation of that learner id still held.

Group bytes travel inside the ZeroMQ frames and are never re-encoded on their way through: the
buffer decodes a group only to validate it, keeps the received frame, appends it to the segment
log as is and forwards it to the learner. A batch is one multipart message: frame 0 is the
encoded ``SampleBatch`` with an empty ``groups`` list, frames 1..n are the groups, each the exact
frame its actor sent (ZeroMQ shares the buffer, no copy); :class:`buffer.client.LearnerClient`
reassembles the ``SampleBatch``.

One loop turn: poll -> learner messages, serve held requests -> a bounded batch of actor
messages (each accepted group appended to the segment log), serve again -> hand the log to its
flusher (``buffer.fsync = batch``: group commit in a background thread) -> send what has become
durable -> compact the log when due. Every outgoing message is queued with the log position
(LSN) it depends on -- the end of its group's record for an ``ok`` ack or a batch, everything
written so far for the rest -- and leaves, in order per socket, only once the log is durable up
to there: no ack and no batch ever leaves before the records it depends on are durable, while
the next groups are received, validated and appended during the fsync. The learner goes first
so that its round trip, which paces the whole pipeline, does not queue behind a flood of actor
messages.

Hostile input: frames above ``buffer.max_frame_bytes`` are counted as ``oversize`` without
being decoded (ZeroMQ's own MAXMSGSIZE sits a little higher, as a memory guard that drops the
connection); anything the typed decoder or ``validate_group`` refuses is counted in
``buffer/dropped_invalid/<reason>`` and answered with a ``rejected`` ack when the key can be
recovered. Nothing a peer sends can stop the loop.

Security: sockets bind through ``core.net.bind`` (loopback unless CURVE keys are configured);
with CURVE, a ZAP handler admits only ``net.curve_client_public``.

Run: ``python -m buffer.server --config RUN_DIR/config.json --run-dir RUN_DIR``; it writes the
bound ports to ``RUN_DIR/buffer/ports.json`` and stops cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

import msgspec
import zmq

from buffer.persist import SegmentLog
from buffer.store import Entry, Store, entry_from_group
from core import config as C
from core import net
from core.files import atomic_write
from core.messages import (ACTOR_TO_BUFFER, LEARNER_TO_BUFFER, SCHEMA_VERSION, Ack, Acks, Consumed, Hello,
                           InvalidMessage, RolloutGroup, SampleBatch, SampleRequest, decoder, encode,
                           validate_group)

log = logging.getLogger("driftrl.buffer")

# ZeroMQ drops (and disconnects) frames above max_frame_bytes + this; between the two the
# frame is received and counted as "oversize", so hostile traffic stays visible in the metrics
ZMQ_SLACK_BYTES = 64 << 10
# actor messages per loop turn (~1 ms of work): acks keep flowing under a flood and the learner is
# served at least once per turn; with group commit, an fsync covers whatever arrived meanwhile
# (8 measured ~5% faster than 16 or 32 in bench/buffer.py, 4 no better)
MAX_BATCH_MSGS = 8
MAX_BATCH_BYTES = 4 << 20
MAX_ID_CHARS = 128
ZERO_COPY_BYTES = 64 << 10  # below this, pyzmq's zero-copy bookkeeping costs more than a copy
POLL_MS = 100  # upper bound on reaction time to stop_event; arrivals wake the poll at once
METRICS_EVERY_S = 1.0


@dataclass
class _Learner:
    name: str  # lessee name: the Hello id, else the socket identity
    pending: SampleRequest | None = None
    answered: int = -1  # last request id served (resends of it are ignored)


class BufferServer:
    def __init__(self, cfg: C.Config, run_dir: str, metrics: Callable[[dict], None] | None = None,
                 ctx: zmq.Context | None = None):
        b = cfg.buffer
        self.metrics = metrics
        self.max_frame = b.max_frame_bytes
        self.store = Store(b.capacity_groups, b.capacity_bytes, b.max_staleness, b.policy)
        self.invalid: Counter = Counter()
        self.learner_version: int | None = None  # latest the learner told us
        self.corrupt_segments = 0
        self.send_failed = 0
        self._actor_dec = decoder(ACTOR_TO_BUFFER)
        self._learner_dec = decoder(LEARNER_TO_BUFFER)
        self._group_dec = decoder(RolloutGroup)
        self._actor_ident: dict[str, bytes] = {}  # actor id -> socket identity, for late acks
        self._learners: dict[bytes, _Learner] = {}
        # per socket, in queueing order: (frames, log position they wait for)
        self._outbox: dict[str, deque[tuple[list, int]]] = {"actor": deque(), "learner": deque()}
        self._next_metrics = 0.0
        self._invariant_reported = False
        self._own_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        self.actor_sock = self.learner_sock = None
        self._auth = None
        self.log: SegmentLog | None = None
        try:
            self._bind(cfg.net)
            if b.persist:
                self.log = SegmentLog(os.path.join(run_dir, "buffer"), b.segment_bytes, b.fsync)
                self._recover()
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self.actor_sock, zmq.POLLIN)
        self._poller.register(self.learner_sock, zmq.POLLIN)
        self._wake_fd = self.log.wake_fd if self.log is not None else None
        if self._wake_fd is not None:  # a background fsync finished: release what waited for it
            self._poller.register(self._wake_fd, zmq.POLLIN)
        log.info("buffer listening on %s: actors :%d, learner :%d; %d groups recovered",
                 cfg.net.host, self.actor_port, self.learner_port, self.store.counters.recovered)

    def _bind(self, n) -> None:
        curve = net.curve_from_config(n)
        if curve is not None and n.curve_client_public:
            self._start_auth(n.curve_client_public)
        cap = self.max_frame + ZMQ_SLACK_BYTES
        self.actor_sock = net.socket(self.ctx, zmq.ROUTER, max_msg=cap)
        self.learner_sock = net.socket(self.ctx, zmq.ROUTER, max_msg=cap)
        for s in (self.actor_sock, self.learner_sock):
            # a client reconnecting under its fixed identity takes over from its stale session
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.actor_port = net.bind(self.actor_sock, n.host, n.buffer_actor_port, curve)
        self.learner_port = net.bind(self.learner_sock, n.host, n.buffer_learner_port, curve)

    def _start_auth(self, client_public: str) -> None:
        """Only the configured client key may complete the CURVE handshake (ZAP). Without this, any
        key pair that knows the server's public key would be let in."""
        from zmq.auth.thread import ThreadAuthenticator

        class _Allow:
            def callback(self, domain, key):
                return key == client_public.encode()

        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_Allow())

    def _recover(self) -> None:
        rep = self.log.replay()
        seen = self.store.seen
        for snap in rep.seen:
            seen.merge(snap)
        for key in rep.done_keys:
            seen.add(key)
        for key, raw in rep.groups.items():
            self.store.restore(entry_from_group(self._group_dec.decode(raw), raw))
        self.corrupt_segments = rep.corrupt
        self.log.open(seen.snapshot)

    # ---- the loop ----------------------------------------------------------------------------

    def serve_forever(self, stop_event=None) -> None:
        try:
            while stop_event is None or not stop_event.is_set():
                self.step(POLL_MS)
        finally:
            self.close()

    def step(self, timeout_ms: int = POLL_MS) -> None:
        """One loop turn (public so tests can drive the server without a thread)."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_fd in ready:
            self.log.drain_wake()
        if self.learner_sock in ready:  # first: see the module docstring
            self._drain(self.learner_sock, self._on_learner)
            self._serve_requests()
            self._flush_outbox()
        if self.actor_sock in ready:
            self._drain(self.actor_sock, self._on_actor)
            self._serve_requests()
        if self.log is not None:
            self.log.commit(wait=False)
        self._flush_outbox()
        self._maybe_compact()
        now = time.monotonic()
        if now >= self._next_metrics:
            self._next_metrics = now + METRICS_EVERY_S
            self._report()

    def _drain(self, sock: zmq.Socket, handle) -> None:
        nbytes = 0
        for _ in range(MAX_BATCH_MSGS):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            if len(frames) != 2:
                self.invalid["multipart"] += 1
                continue
            payload = frames[1]  # a zmq.Frame: decoded, logged and forwarded without a copy
            nbytes += len(payload)
            handle(ident, payload)
            if nbytes >= MAX_BATCH_BYTES:
                return

    # ---- actors ------------------------------------------------------------------------------

    def _on_actor(self, ident: bytes, data) -> None:
        msg = self._decode(self._actor_dec, data, ident, actor=True)
        if isinstance(msg, RolloutGroup):
            self._on_group(ident, msg, data)
        elif isinstance(msg, Hello):
            self._on_actor_hello(ident, msg)

    def _on_actor_hello(self, ident: bytes, msg: Hello) -> None:
        if msg.schema_version != SCHEMA_VERSION or len(msg.id) > MAX_ID_CHARS:
            reason = "schema_version" if msg.schema_version != SCHEMA_VERSION else "bad_actor_id"
            self.invalid[reason] += 1
            self._ack(ident, Ack(msg.id[:MAX_ID_CHARS], -1, "rejected", reason))
            return
        self._actor_ident[msg.id] = ident
        # tells an actor that lost its local counter where its seq numbering resumes
        self._ack(ident, Ack(msg.id, self.store.seen.next_seq(msg.id), "hello"))

    def _on_group(self, ident: bytes, g: RolloutGroup, raw) -> None:
        try:
            if len(g.actor_id) > MAX_ID_CHARS:
                raise InvalidMessage("bad_actor_id")
            min_version = validate_group(g)
        except InvalidMessage as e:
            self._reject(ident, g.actor_id, g.seq, e.reason)
            return
        self._actor_ident[g.actor_id] = ident
        entry = entry_from_group(g, raw, min_version)
        if self.log is not None:
            self.log.make_room(len(raw))  # before offer() marks the key seen: see make_room
        status, reason = self.store.offer(entry, self.learner_version)
        lsn = 0  # busy / rejected promise nothing about the disk
        if status == "ok" and self.log is not None:
            self.log.append_group(entry.key, raw)
            entry.lsn = lsn = self.log.written
        elif status == "duplicate":
            lsn = self._durable_lsn(entry.key)
        self._ack(ident, Ack(g.actor_id, g.seq, status, reason), lsn)

    def _durable_lsn(self, key) -> int:
        """"Already accepted" is a promise too: the ack waits until the key's record is durable."""
        if self.log is None:
            return 0
        held = self.store.resident.get(key)
        return held.lsn if held is not None else self.log.written

    def _reject(self, ident: bytes, actor: str, seq: int, reason: str) -> None:
        self.invalid[reason] += 1
        self._ack(ident, Ack(actor[:MAX_ID_CHARS], seq, "rejected", reason))

    def _ack(self, ident: bytes, ack: Ack, lsn: int | None = None) -> None:
        self._queue("actor", [ident, ack], lsn)  # encoded when sent: see _flush_outbox

    def _queue(self, dest: str, frames: list, lsn: int | None = None) -> None:
        """Send ``frames`` once the log is durable up to ``lsn`` (default: all written so far)."""
        if lsn is None:
            lsn = self.log.written if self.log is not None else 0
        self._outbox[dest].append((frames, lsn))

    # ---- learners ----------------------------------------------------------------------------

    def _on_learner(self, ident: bytes, data) -> None:
        msg = self._decode(self._learner_dec, data, ident, actor=False)
        if msg is None:
            return
        st = self._learners.get(ident)
        if st is None:
            st = self._learners[ident] = _Learner(ident.hex())
        if isinstance(msg, SampleRequest):
            if msg.num_groups < 1 or msg.learner_version < 0:
                self.invalid["bad_request"] += 1
            elif msg.request_id > st.answered:  # else: a resend of one already answered
                st.pending = msg
                self.learner_version = msg.learner_version
        elif isinstance(msg, Consumed):
            self.learner_version = msg.learner_version
            done = self.store.consume(msg.keys)
            if self.log is not None:
                self.log.append_done([e.key for e in done], "consumed")
        elif isinstance(msg, Hello):
            if msg.schema_version != SCHEMA_VERSION:
                self.invalid["schema_version"] += 1
                return
            # a (re)started learner: whatever an earlier incarnation held but never consumed
            # was not trained on, so it is available again
            st.name, st.pending, st.answered = msg.id, None, -1
            released = self.store.release(msg.id)
            if released:
                log.info("learner %s (re)connected: %d leased groups released", msg.id, released)

    def _serve_requests(self) -> None:
        store = self.store
        for ident, st in self._learners.items():
            req = st.pending
            if req is None:
                continue
            n = min(req.num_groups, store.capacity_groups)
            avail = store.available()
            # full buffer: serve what there is rather than wait for groups that cannot fit
            partial = store.saturated and avail > 0
            if avail < n and not partial:
                continue
            taken, drops = store.take(n, req.learner_version, lessee=st.name,
                                      at_least=1 if partial else n)
            self._dropped(drops)
            if not taken:
                continue
            st.pending, st.answered = None, req.request_id
            head = encode(SampleBatch(req.request_id, [], len(store.resident)))
            frames = [ident, head, *[e.raw for e in taken]]
            # it depends only on its groups' records, not on the DONE records written since
            self._queue("learner", frames, max(e.lsn for e in taken))

    def _dropped(self, drops: list[Entry]) -> None:
        if not drops:
            return
        if self.log is not None:
            self.log.append_done([e.key for e in drops], "stale")
        for e in drops:
            ident = self._actor_ident.get(e.key[0])
            if ident is not None:  # lets the actor give back its admission quota
                self._ack(ident, Ack(e.key[0], e.key[1], "dropped", "stale"))

    # ---- plumbing ----------------------------------------------------------------------------

    def _decode(self, dec, data, ident: bytes, actor: bool):
        if len(data) > self.max_frame:
            self.invalid["oversize"] += 1
            return None
        try:
            return dec.decode(data)
        except msgspec.ValidationError:
            reason = "bad_fields"
        except msgspec.DecodeError:
            reason = "decode_error"
        self.invalid[reason] += 1
        key = _recover_key(data) if actor else None
        if key is not None:
            self._ack(ident, Ack(key[0], key[1], "rejected", reason))
        return None

    def _flush_outbox(self) -> None:
        """Send, in order per socket, every queued message whose records are durable."""
        durable = self.log.durable if self.log is not None else 0
        out = self._outbox["actor"]
        ready: dict[bytes, list[Ack]] = {}  # per actor, in order: one message for all its acks
        while out and out[0][1] <= durable:
            (ident, ack), _ = out.popleft()
            ready.setdefault(ident, []).append(ack)
        for ident, acks in ready.items():
            self._send(self.actor_sock, [ident, encode(acks[0] if len(acks) == 1 else Acks(acks))])
        out = self._outbox["learner"]
        while out and out[0][1] <= durable:
            self._send(self.learner_sock, out.popleft()[0])

    def _send(self, sock: zmq.Socket, frames: list) -> None:
        try:
            _send_frames(sock, frames)
        except zmq.ZMQError:  # peer gone or its queue full: it resends / re-requests
            self.send_failed += 1

    def _resident_records(self):
        return ((k, e.raw) for k, e in self.store.resident.items())

    def _maybe_compact(self) -> None:
        if self.log is not None and self.log.maybe_compact(self._resident_records):
            self._flush_outbox()  # a compaction leaves everything durable

    def stats(self) -> dict[str, float]:
        out = self.store.stats()
        out["buffer/dropped_invalid"] = float(sum(self.invalid.values()))
        out["buffer/send_failed"] = float(self.send_failed)  # peers gone or not reading
        for reason, n in self.invalid.items():
            out[f"buffer/dropped_invalid/{reason}"] = float(n)
        if self.log is not None:
            out["buffer/disk_bytes"] = float(self.log.disk_bytes)
            out["buffer/file_bytes"] = float(self.log.file_bytes)
            out["buffer/recycled_segments"] = float(self.log.recycled)
            out["buffer/segments"] = float(len(self.log.segments))
            out["buffer/corrupt_segments"] = float(self.corrupt_segments)
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
            if self.log is not None:
                log.info("segment log: %d segments, %d rolls reused a file, %d compactions",
                         len(self.log.segments), self.log.recycled, self.log.compactions)
        if self.log is not None:
            self.log.close()
            self.log = None
        for s in (self.actor_sock, self.learner_sock):
            if s is not None:
                s.close(linger=0)
        self.actor_sock = self.learner_sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()


def _send_frames(sock: zmq.Socket, frames: list) -> None:
    """One multipart message; big frames (groups) go zero-copy, small ones are copied (cheaper)."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        sock.send(f, zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0), copy=len(f) < ZERO_COPY_BYTES)


def _recover_key(data) -> tuple[str, int] | None:
    """(actor_id, seq) of a group frame the typed decoder refused, if it is still readable."""
    try:
        obj = msgspec.msgpack.decode(data)
    except Exception:  # any garbage: there is simply no key to answer to
        return None
    if (isinstance(obj, list) and len(obj) >= 3 and obj[0] == "group" and isinstance(obj[1], str)
            and len(obj[1]) <= MAX_ID_CHARS and type(obj[2]) is int):
        return obj[1], obj[2]
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
    sink = server = None
    if cfg.net.metrics_port:
        from core.metrics import MetricsSink

        sink = MetricsSink(cfg.net.host, cfg.net.metrics_port, "buffer", "buffer",
                           curve=net.curve_from_config(cfg.net))

    def emit(values: dict) -> None:
        sink.emit(server.learner_version or 0, values)

    try:
        server = BufferServer(cfg, args.run_dir, metrics=emit if sink else None)
        _write_ports(args.run_dir, server)
        server.serve_forever(stop)
    finally:
        if sink is not None:
            sink.close()
        log.info("buffer stopped")


def _write_ports(run_dir: str, server: BufferServer) -> None:
    """Publish the bound ports (they differ from the config when it asked for port 0)."""
    d = os.path.join(run_dir, "buffer")
    os.makedirs(d, exist_ok=True)
    ports = {"actor": server.actor_port, "learner": server.learner_port, "pid": os.getpid()}
    atomic_write(os.path.join(d, "ports.json"), json.dumps(ports).encode(), durable=False)


if __name__ == "__main__":
    main()
