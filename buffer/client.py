"""Clients of the buffer server (what each keeps: buffer/__init__.py): :class:`ActorClient` sends its window's
due groups as one message; :class:`LearnerClient` never returns a key twice, even across a buffer restart.

Both are DEALERs with a fixed identity and ``ZMQ_IMMEDIATE`` (while the buffer is down nothing piles
up in ZeroMQ: sends fail fast and are retried here), present the run's secret in their ``Hello``
and say Hello again when a restarted buffer answers ``unauthenticated``. Every wait ends on the
caller's stop flag, and an actor's wait without a deadline raises :class:`BufferUnavailable` after
``timeout_s`` of silence (a launcher that died takes the buffer with it).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import tempfile
import time
import uuid
from typing import Callable

import msgspec
import zmq

from core import net
from core.messages import (BUFFER_TO_ACTOR, BUFFER_TO_LEARNER, MAX_GROUPS_PER_MSG, Ack, Acks, Consumed, Control,
                           Hello, InFlight, RolloutGroup, SampleBatch, SampleRequest, decoder, encode)

log = logging.getLogger("driftrl.buffer.client")

WINDOW = 32  # unacked groups: two default learner steps' worth, so a step's groups go as one message
RESEND_S = 2.0
BUSY_BACKOFF_S = (0.02, 1.0)  # first and largest wait before resending a group the buffer refused
HELLO_TIMEOUT_S = 60.0
SILENCE_TIMEOUT_S = 120.0  # an ActorClient wait with no deadline of its own gives up after this
RETRY_UNSENT_S = 0.02  # a send refused while disconnected is retried this often
STOP_POLL_S = 0.1  # how long a wait may go without looking at the stop flag
RECENT_KEYS = 1 << 16
_GROUP = decoder(RolloutGroup)


class Stopped(Exception):
    """The caller's stop flag was set during a wait that cannot return a result."""


class BufferUnavailable(TimeoutError):
    """The buffer did not answer in time."""


def _stop_flag(stop) -> Callable[[], bool]:
    """``stop`` (None, a threading.Event or a callable returning bool) as a callable."""
    if stop is None:
        return lambda: False
    return stop.is_set if hasattr(stop, "is_set") else stop


def run_token(cfg, run_dir: str | None = None, token: str | None = None) -> str:
    """The secret a client presents: ``token``, else the run's; "" without a secret file (any Hello is accepted)."""
    if token is not None:
        return token
    d = run_dir or cfg.run.run_dir
    return net.run_secret(d) if d and os.path.exists(os.path.join(d, net.SECRET_FILE)) else ""


def _dealer(ctx: zmq.Context, cfg, port: int, role: str, name: str) -> zmq.Socket:
    s = net.socket(ctx, zmq.DEALER, linger_ms=0)
    s.identity = f"{role}:{name}:{uuid.uuid4().hex[:12]}".encode()
    s.setsockopt(zmq.IMMEDIATE, 1)
    net.connect(s, cfg.net.host, port, net.curve_from_config(cfg.net))
    return s


def _drain(sock, timeout_ms: int):
    """Every message waiting on ``sock`` (its frames), after waiting up to ``timeout_ms`` for the first."""
    if timeout_ms and not sock.poll(timeout_ms):
        return
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


def _try_send(sock: zmq.Socket, payload: bytes | list[bytes]) -> bool:
    """Send one message (a list: one frame each, delivered together or not at all)."""
    try:
        net.send_frames(sock, payload if isinstance(payload, list) else [payload])
        return True
    except zmq.Again:  # not connected (IMMEDIATE) or queue full: caller retries
        return False


def spool_path(run_dir: str, actor_id: str) -> str:
    # a digest, not the id: an actor id is arbitrary text and must never become a path
    return os.path.join(run_dir, "spool", hashlib.blake2b(actor_id.encode(), digest_size=16).hexdigest())


class Spool:
    """An actor's unacknowledged groups. Each chunk of :meth:`ActorClient.send_many` is one record (its
    size, then a msgpack list of the encoded groups) written after the last in this incarnation's
    file; the file is emptied (truncated) once every group in it is settled, and a new one started
    once it holds ``FILE_BYTES`` without emptying. A write and a truncate cost ~5 us of CPU where a
    file per chunk cost ~100 us to create and delete, more than the rest of the actor's side of a
    small group. A record cut short by a kill ends its file: its groups were never sent. An earlier
    incarnation's files go once their groups are settled."""

    FILE_BYTES = 16 << 20
    _SIZE = 8  # bytes of a record's size prefix

    def __init__(self, directory: str, actor_id: str):
        self.dir, self.actor_id = directory, actor_id
        self._file_of: dict[int, str] = {}  # unsettled seq -> its file
        self._left: dict[str, int] = {}  # file -> its unsettled groups
        self._fd, self._name, self._size = -1, "", 0  # the file written to, and its size
        os.makedirs(directory, exist_ok=True)

    def pending(self) -> list[tuple[int, bytes]]:
        """``(seq, payload)`` of every group an earlier incarnation left unacked, by seq."""
        out = []
        for name in os.listdir(self.dir):
            groups = self._read(name)
            if not groups:  # empty, cut short before its first record, or not ours: nothing to send
                os.unlink(os.path.join(self.dir, name))
                continue
            self._track(name, [seq for seq, _ in groups])
            out += groups
        return sorted(out)

    def put(self, seqs: list[int], payloads: list[bytes]) -> None:
        if self._fd < 0 or self._size >= self.FILE_BYTES:
            self._start()
        body = msgspec.msgpack.encode(payloads)
        record = memoryview(len(body).to_bytes(self._SIZE, "little") + body)
        try:
            at = self._size
            while record:  # (a regular file takes it all at once)
                n = os.pwrite(self._fd, record, at)
                record, at = record[n:], at + n
        except OSError:  # a full disk: no torn record stays in front of the next one
            os.ftruncate(self._fd, self._size)
            raise
        self._size = at
        self._track(self._name, seqs)

    def settle(self, seq: int) -> None:
        """``seq`` is acked (or refused for good); its file is emptied (or goes) with the last of its groups."""
        name = self._file_of.pop(seq, None)
        if name is None:
            return
        self._left[name] -= 1
        if self._left[name]:
            return
        del self._left[name]
        if name == self._name:
            os.ftruncate(self._fd, 0)
            self._size = 0
        else:
            os.unlink(os.path.join(self.dir, name))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _start(self) -> None:
        if self._name and not self._left.get(self._name):  # an empty file is not kept
            os.unlink(os.path.join(self.dir, self._name))
        self.close()
        self._fd, path = tempfile.mkstemp(".groups", dir=self.dir)  # 0600, a name no file had
        self._name, self._size = os.path.basename(path), 0

    def _track(self, name: str, seqs: list[int]) -> None:
        self._left[name] = self._left.get(name, 0) + len(seqs)
        self._file_of.update(dict.fromkeys(seqs, name))

    def _read(self, name: str) -> list[tuple[int, bytes]] | None:
        if not name.endswith(".groups"):
            return None
        with open(os.path.join(self.dir, name), "rb") as f:
            data = f.read()
        out, at = [], 0
        while at + self._SIZE <= len(data):
            end = at + self._SIZE + int.from_bytes(data[at:at + self._SIZE], "little")
            try:
                payloads = msgspec.msgpack.decode(data[at + self._SIZE:end], type=list[bytes])
                groups = [_GROUP.decode(p) for p in payloads]
            except msgspec.DecodeError:  # cut short (ends past the data) or damaged: the file ends here
                break
            if not groups or any(g.actor_id != self.actor_id for g in groups):
                return None
            out += [(g.seq, p) for g, p in zip(groups, payloads)]
            at = end
        return out


class _Pending:
    __slots__ = ("seq", "payload", "sent_at", "retry_at", "busy")

    def __init__(self, seq: int, payload: bytes):
        self.seq, self.payload = seq, payload  # payload: the encoded group, (re)sent as is
        self.busy = 0  # consecutive "busy" answers
        self.sent_at: float | None = None
        self.retry_at = 0.0


class ActorClient:
    def __init__(self, cfg, actor_id: str, ctx: zmq.Context | None = None, spool_dir: str | None = None,
                 window: int = WINDOW, resend_s: float = RESEND_S,
                 on_ack: Callable[[Ack], None] | None = None, run_dir: str | None = None,
                 token: str | None = None, stop=None, timeout_s: float = SILENCE_TIMEOUT_S):
        if not 1 <= window <= MAX_GROUPS_PER_MSG:  # the window's groups may travel as one message
            raise ValueError(f"window {window}: 1..{MAX_GROUPS_PER_MSG} groups")
        self.actor_id, self.window, self.resend_s, self.on_ack = actor_id, window, resend_s, on_ack
        self.timeout_s, self._stop = timeout_s, _stop_flag(stop)
        self._heard_at = 0.0  # when the buffer last answered anything
        self._authed = False  # the buffer has answered our Hello on this connection
        self.admission_wait_s = 0.0
        self._pending: dict[int, _Pending] = {}  # insertion order == seq order
        # bookkeeping that spares a wait its scan of _pending when nothing is due
        self._due = 0.0  # no entry among the first `window` needs a (re)send before this time
        self._busy_n = 0  # pending groups the buffer answered "busy" and has not taken since
        self._notices: list[Ack] = []
        self._server_next: int | None = None  # from the Hello answer
        self.control: tuple[int, bool] | None = None  # (max_staleness, paused): see the docstring
        self._hello = encode(Hello("actor", actor_id, token=run_token(cfg, run_dir, token)))
        self._hello_at: float | None = None
        self._report, self._report_due = None, False  # the latest InFlight, and whether to (re)send it
        self._dec = decoder(BUFFER_TO_ACTOR)
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._sock = _dealer(self._ctx, cfg, cfg.net.buffer_actor_port, "actor", actor_id)
        path = spool_dir or (spool_path(run_dir, actor_id) if run_dir else None)
        self._spool = Spool(path, actor_id) if path else None
        for seq, payload in self._spool.pending() if self._spool else ():  # _due = 0: _pump sends them
            self._pending[seq] = _Pending(seq, payload)
        self._next = max(self._pending, default=-1) + 1
        self._pump()

    # ---- public ------------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def next_seq(self) -> int:
        """A seq the buffer never accepted and no spooled group holds: above the buffer's answer
        to the Hello (the first call waits for it) and above the spool."""
        if self._server_next is None:
            self._await_hello()
        seq = self._next
        self._next += 1
        return seq

    def send(self, group: RolloutGroup) -> None:
        """Queue ``group`` until acked; blocks while the window is full or the buffer is busy --
        until the stop flag is set (then it returns, the groups not sent yet in the spool) or the
        buffer has been silent for ``timeout_s`` (:class:`BufferUnavailable`)."""
        self.send_many([group])

    def resend(self, groups: list[RolloutGroup]) -> int:
        """Send again groups an earlier incarnation handed over under these seqs (actor/partial.py) unless the
        spool holds them (how many went); the buffer answers "duplicate" for one it has: exactly once either way."""
        groups = [g for g in groups if g.seq not in self._pending]
        if groups:
            self._next = max(self._next, 1 + max(g.seq for g in groups))  # never issued again
            self.send_many(groups)
        return len(groups)

    def send_many(self, groups: list[RolloutGroup]) -> None:
        """:meth:`send` for groups finished together."""
        seqs = {g.seq for g in groups}
        for g in groups:
            if g.actor_id != self.actor_id:
                raise ValueError(f"group of actor {g.actor_id!r} sent through the client of "
                                 f"{self.actor_id!r}")
            if g.seq in self._pending:
                raise ValueError(f"seq {g.seq} is already in flight for {self.actor_id!r}")
        if len(seqs) != len(groups):
            raise ValueError("the same seq twice in one send_many")
        self._receive(0)
        i = 0
        while i < len(groups):
            t0 = time.monotonic()
            room = self._wait_until(lambda: len(self._pending) < self.window and not self._busy_n, None)
            self.admission_wait_s += time.monotonic() - t0
            if not room:  # stopped: the rest waits in the spool for the next incarnation
                self._spool_pending(groups[i:])
                return
            chunk = groups[i:i + self.window - len(self._pending)]
            i += len(chunk)
            self._spool_pending(chunk)
            self._due = 0.0  # they are due: _pump sends every due group of the window, in one message
            self._pump()

    def _spool_pending(self, groups: list[RolloutGroup]) -> list[_Pending]:
        new = [self._pending.setdefault(g.seq, _Pending(g.seq, encode(g))) for g in groups]
        if self._spool is not None:  # before the first send: no group is out without its copy
            self._spool.put([p.seq for p in new], [p.payload for p in new])
        return new

    def poll(self, timeout_ms: int = 0) -> list[Ack]:
        """Process acks; return those the actor must act on (``rejected``/``dropped``)."""
        self._receive(timeout_ms)
        self._pump()
        out, self._notices = self._notices, []
        return out

    def flush(self, timeout_s: float) -> bool:
        """Wait until every group sent so far is acked; False on timeout or stop."""
        return self._wait_until(lambda: not self._pending, time.monotonic() + timeout_s)

    def in_flight(self, oldest: int) -> None:
        """Tell the buffer the start version of the oldest group being generated (-1: none); again after a reconnect."""
        self._report = encode(InFlight(oldest))
        self._report_due = True
        self._pump()

    def settle(self, timeout_s: float) -> int:
        """At exit, stopped or not: up to ``timeout_s`` for the acks of the groups in flight; how many are left."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self.poll(50)
        return len(self._pending)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()
        if self._spool is not None:
            self._spool.close()

    # ---- internals ---------------------------------------------------------------------------

    def _await_hello(self) -> None:
        """Without the buffer's answer no seq is safe to use (one it accepted before may be
        reused): raises Stopped or BufferUnavailable instead of guessing."""
        t0, limit = time.monotonic(), min(HELLO_TIMEOUT_S, self.timeout_s)
        answered = self._wait_until(lambda: self._server_next is not None, t0 + limit)
        self.admission_wait_s += time.monotonic() - t0
        if not answered and self._stop():
            raise Stopped(f"{self.actor_id}: stopped while waiting for the buffer's Hello answer")
        if not answered:
            raise BufferUnavailable(f"{self.actor_id}: no answer from the buffer in {limit:.0f}s")

    def _wait_until(self, done: Callable[[], bool], deadline: float | None) -> bool:
        """Pump until ``done()``; False once ``deadline`` passes or the stop flag is set. Without a
        deadline, BufferUnavailable after ``timeout_s`` without a word from the buffer."""
        start = time.monotonic()
        while not done():
            now = time.monotonic()
            if self._stop() or (deadline is not None and now >= deadline):
                return False
            if deadline is None and now - max(start, self._heard_at) > self.timeout_s:
                raise BufferUnavailable(f"{self.actor_id}: no answer from the buffer in {self.timeout_s:.0f}s "
                                        f"({len(self._pending)} groups unacked)")
            wait = min(self._next_due(now) - now, STOP_POLL_S)
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._receive(max(1, int(wait * 1000)))
            self._pump()
        return True

    def _next_due(self, now: float) -> float:
        due = now + self.resend_s
        if not self._authed:
            due = min(due, (self._hello_at or now) + (self.resend_s if self._hello_at else RETRY_UNSENT_S))
        if self._pending:  # _due <= now after _pump: a send was refused (not connected), retry soon
            due = min(due, now + RETRY_UNSENT_S if self._due <= now else self._due)
        return due

    def _pump(self) -> None:
        """(Re)send whatever is due: the Hello, then the first ``window`` unacked groups."""
        now = time.monotonic()
        if not self._authed and (self._hello_at is None or now - self._hello_at >= self.resend_s):
            if _try_send(self._sock, self._hello):
                self._hello_at = now
        if self._report_due and self._authed:
            self._report_due = not _try_send(self._sock, self._report)
        if now < self._due:  # nothing is unsent or due for a resend: skip the scan
            return
        due, out = float("inf"), []
        for i, p in enumerate(self._pending.values()):
            if i >= self.window:
                break
            if p.sent_at is None or now >= p.retry_at:
                out.append(p)
            else:
                due = min(due, p.retry_at)
        if out and not _try_send(self._sock, [p.payload for p in out]):  # one message, in seq order
            self._due = 0.0  # retried on the next pump (_next_due paces it)
            return
        for p in out:
            p.sent_at, p.retry_at = now, now + self.resend_s
        self._due = min(due, now + self.resend_s) if out else due

    def _receive(self, timeout_ms: int) -> None:
        for frames in _drain(self._sock, timeout_ms):
            self._heard_at = time.monotonic()
            try:
                msg = self._dec.decode(frames[0].buffer)  # answers are one frame
            except msgspec.DecodeError:  # not an answer of this schema: nothing to act on
                continue
            if isinstance(msg, Control):
                self.control = (msg.max_staleness, msg.pause)
            for ack in msg.acks if isinstance(msg, Acks) else (msg,) if isinstance(msg, Ack) else ():
                if ack.actor_id == self.actor_id:
                    self._on_ack(ack)

    def _on_ack(self, ack: Ack) -> None:
        st = ack.status
        if st == "hello":
            self._server_next, self._authed = ack.seq, True
            self._next = max(self._next, ack.seq)
            self._report_due = self._report is not None  # a new connection (or buffer) has not heard it
            return
        p = self._pending.get(ack.seq)
        if st == "unauthenticated":  # a restarted buffer: say Hello again at once, p right behind it
            self._authed, self._hello_at = False, None
            if p is not None:
                p.retry_at, self._due = 0.0, 0.0
            return
        if st in ("ok", "duplicate"):
            if p is not None:
                self._finish(p)
        elif st == "busy":
            if p is not None:
                p.busy += 1  # exponential backoff per group, so one busy spell costs one wait
                self._busy_n += p.busy == 1
                p.retry_at = time.monotonic() + min(BUSY_BACKOFF_S[0] * 2 ** (p.busy - 1), BUSY_BACKOFF_S[1])
                self._due = min(self._due, p.retry_at)
        elif st == "rejected":
            if ack.seq < 0:  # our Hello: wrong schema, nothing this actor sends can be accepted
                raise RuntimeError(f"buffer refused actor {self.actor_id!r}: {ack.reason}")
            if p is None:  # the answer to a resend of a group already settled
                return
            self._finish(p)
            self._notices.append(ack)
        elif st == "dropped":
            self._notices.append(ack)
        if self.on_ack is not None:
            self.on_ack(ack)

    def _finish(self, p: _Pending) -> None:
        del self._pending[p.seq]
        self._busy_n -= p.busy > 0
        if len(self._pending) >= self.window:  # one beyond the window moved into it, maybe unsent
            self._due = 0.0
        if self._spool is not None:
            self._spool.settle(p.seq)


class _RecentKeys(collections.OrderedDict):
    """A bounded mapping: the last ``maxlen`` keys added, each with a value."""

    def __init__(self, maxlen: int = RECENT_KEYS):
        super().__init__()
        self.maxlen = maxlen

    def add(self, key, value=None) -> None:
        self[key] = value
        if len(self) > self.maxlen:
            self.popitem(last=False)


class LearnerClient:
    def __init__(self, cfg, ctx: zmq.Context | None = None, learner_id: str = "learner",
                 resend_s: float = RESEND_S, run_dir: str | None = None, token: str | None = None,
                 stop=None, step: int = -1, version: int = -1):
        self.learner_id, self.resend_s, self._stop = learner_id, resend_s, _stop_flag(stop)
        self.step, self.version = step, version  # of the weights held: what each Hello tells the buffer
        self._token = run_token(cfg, run_dir, token)
        self.filtered = 0  # groups served twice across a buffer restart, kept from the caller
        self._dec = decoder(BUFFER_TO_LEARNER)
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._sock = _dealer(self._ctx, cfg, cfg.net.buffer_learner_port, "learner", learner_id)
        self._unsent: collections.deque = collections.deque()
        self._need_hello = True
        self._req_id = self._floor = 0
        self._version = 0  # learner version of the latest sample() call
        self._request: SampleRequest | None = None
        self._sent_at: float | None = None
        self._ready: collections.deque = collections.deque()
        self._delivered = _RecentKeys()
        self._consumed = _RecentKeys()  # key -> the step that trained it
        self._flush_unsent()

    def sample(self, num_groups: int, learner_version: int, timeout_s: float | None = None,
               max_staleness: int = -1, pause_actors: bool = False,
               covered_step: int = -1) -> SampleBatch | None:
        """The next batch of up to ``num_groups`` fresh groups (fewer only from a full buffer, or once returned keys
        are filtered out), or None after ``timeout_s`` or on stop; the control arguments travel with it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._version = learner_version
        while True:
            batch = self._pop_ready()
            if batch is not None:
                return batch
            req, want = self._request, (num_groups, learner_version, max_staleness, pause_actors, covered_step)
            if req is None or (req.num_groups, req.learner_version, req.max_staleness, req.pause_actors,
                               req.covered_step) != want:
                self._req_id += 1
                self._request = SampleRequest(self._req_id, *want)
                self._sent_at = None
            now = time.monotonic()
            if self._stop() or (deadline is not None and now >= deadline):
                return None
            self._pump(now)
            wait = RETRY_UNSENT_S if self._sent_at is None else self._sent_at + self.resend_s - now
            wait = min(wait, STOP_POLL_S) if deadline is None else min(wait, deadline - now, STOP_POLL_S)
            self._receive(max(1, int(wait * 1000)))

    def consumed(self, keys: list[tuple[str, int]], learner_version: int, step: int = -1) -> None:
        """Report groups trained at ``step`` (after the optimiser step), or never to be trained (-1)."""
        keys = [(str(a), int(s)) for a, s in keys]
        for k in keys:
            self._consumed.add(k, step)
        self._unsent.append(encode(Consumed(keys, learner_version, step)))
        self._flush_unsent()

    def restart(self, step: int, version: int) -> None:
        """A new incarnation holding the weights of ``step`` (a rollback): Hello again (the buffer serves again
        what was trained after ``step``) and forget what was delivered, so that it is returned again."""
        self.step, self.version, self._need_hello, self._request = step, version, True, None
        self._floor = self._req_id
        self._delivered.clear()
        self._consumed.clear()
        self._ready.clear()
        self._flush_unsent()

    def close(self) -> None:
        if not self._sock.closed:
            self._flush_unsent()
            self._sock.close(linger=500)  # let a last Consumed leave
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    # ---- internals ---------------------------------------------------------------------------

    def _flush_unsent(self) -> bool:
        if self._need_hello:
            hello = Hello("learner", self.learner_id, token=self._token, step=self.step, version=self.version)
            if not _try_send(self._sock, encode(hello)):
                return False
            self._need_hello = False
        while self._unsent:
            if not _try_send(self._sock, self._unsent[0]):
                return False
            self._unsent.popleft()
        return True

    def _pump(self, now: float) -> None:
        if not self._flush_unsent() or self._request is None:
            return
        if self._sent_at is None or now - self._sent_at >= self.resend_s:
            if _try_send(self._sock, encode(self._request)):
                self._sent_at = now

    def _receive(self, timeout_ms: int) -> None:
        for frames in _drain(self._sock, timeout_ms):
            msg = self._dec.decode(frames[0].buffer)  # the buffer is trusted; a failure is a bug
            if isinstance(msg, Ack):
                self._on_ack(msg)
                continue
            if len(frames) > 1:  # the groups follow the header (see buffer.server)
                groups = msg.groups + [_GROUP.decode(f.buffer) for f in frames[1:]]
                msg = msgspec.structs.replace(msg, groups=groups)
            if msg.request_id <= self._floor:  # answers a request of the incarnation before restart()
                continue
            if self._request is not None and msg.request_id == self._request.request_id:
                self._request = None
            self._ready.append(msg)

    def _on_ack(self, ack: Ack) -> None:
        if ack.status == "rejected":  # our Hello: a wrong token or schema, nothing will get through
            raise RuntimeError(f"buffer refused learner {self.learner_id!r}: {ack.reason}")
        if ack.status == "unauthenticated":  # a restarted buffer: Hello again, then the request
            # (a Consumed it ignored is re-sent when its groups are served again: _pop_ready)
            self._need_hello, self._sent_at = True, None

    def _pop_ready(self) -> SampleBatch | None:
        while self._ready:
            batch = self._ready.popleft()
            fresh, again = [], []
            for g in batch.groups:
                key = g.key
                if key in self._delivered:
                    self.filtered += 1
                    if key in self._consumed:
                        again.append(key)
                    continue
                self._delivered.add(key)
                fresh.append(g)
            for step in sorted(set(self._consumed[k] for k in again)):  # lost with the old buffer process
                self._unsent.append(encode(Consumed([k for k in again if self._consumed[k] == step],
                                                    self._version, step)))
            self._flush_unsent()
            if fresh:
                if len(fresh) < len(batch.groups):
                    batch = msgspec.structs.replace(batch, groups=fresh)
                return batch
        return None
