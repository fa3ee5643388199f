"""Reward checking (and tools: :meth:`RewardPool.call`) in killable worker processes, as a thread cannot be stopped
(the pool, its counters and why it is hand-written: ARCHITECTURE.md, Seams). A worker runs the checker in its main
thread (math-verify's ``signal.alarm`` needs it).
"""
from __future__ import annotations

import abc
import argparse
import contextlib
import ctypes
import importlib
import logging
import math
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque

import msgspec

from actor.tasks import Prompt, Task
from core.messages import ScoreReply, ScoreRequest
from core.proc import die_with_parent

log = logging.getLogger("driftrl.rewards")
READY = -1  # the id of a worker's first reply: loaded (or not)
MAX_FRAME_BYTES = 1 << 20  # one answer's payload; far above a completion's text plus a task item
START_TIMEOUT_S = 120.0  # a worker's import + warmup(); reasoning-gym's takes ~2 s
STOP_GRACE_S = 2.0
PROGRESS_S = 10.0
COUNTERS = ("reward/checks", "reward/timeouts", "reward/errors")
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
LOGGED_ERRORS = 10  # the first errors are logged with their message, then every 100th
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEADER = struct.Struct("!I")
_ENCODER = msgspec.msgpack.Encoder()
_REQUESTS = msgspec.msgpack.Decoder(ScoreRequest)
_REPLIES = msgspec.msgpack.Decoder(ScoreReply)


def frame(msg) -> bytes:
    body = _ENCODER.encode(msg)
    return _HEADER.pack(len(body)) + body


class Sandbox(msgspec.Struct, frozen=True):
    """A tool worker's limits: CPU seconds per call, address space, and whether it may reach the network."""

    cpu_s: float = 2.0
    memory_mb: int = 512
    network: bool = False


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1000]


class _Worker:
    """One checker process: starting (no READY yet), idle, or busy with answer ``job``."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.fd = self.proc.stdout.fileno()  # kept: still the selector's key after the pipe is closed
        self.buf, self.ready, self.job, self.deadline = bytearray(), False, None, time.monotonic() + START_TIMEOUT_S

    def read(self) -> list[ScoreReply] | None:
        """The complete replies that have arrived; None at EOF (the process is gone)."""
        data = os.read(self.fd, 65536)
        if not data:
            return None
        self.buf += data
        out = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if n > MAX_FRAME_BYTES:
                raise ValueError(f"reply frame of {n} bytes")
            if len(self.buf) < _HEADER.size + n:
                break
            out.append(_REPLIES.decode(bytes(self.buf[_HEADER.size:_HEADER.size + n])))
            del self.buf[:_HEADER.size + n]
        return out

    def stop(self, grace_s: float = 0.0) -> None:
        """Wait up to ``grace_s`` for it to exit (after EOF on its stdin), then kill it; reap it."""
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # a dead reader: the unflushed bytes have nowhere to go
                pipe.close()


class RewardPool:
    """``workers`` processes running ``scorer`` ("module:function": payload -> float, or str), ``timeout_s`` each."""

    def __init__(self, scorer: str, workers: int, timeout_s: float, *, counters: tuple[str, str, str] = COUNTERS,
                 sandbox: Sandbox | None = None):
        self.scorer, self.timeout_s = scorer, float(timeout_s)
        self.counts = dict.fromkeys(counters, 0.0)  # the task's metrics
        self._checks, self._timeouts, self._errors = counters
        self._argv = [sys.executable, "-m", "actor.rewards", "--scorer", scorer,
                      *(["--sandbox", msgspec.json.encode(sandbox).decode()] if sandbox is not None else [])]
        self._sel, self._workers, self._closed = selectors.DefaultSelector(), [], False
        try:
            for _ in range(workers):
                self._workers.append(self._spawn())
            t0 = note = time.monotonic()
            while not all(w.ready for w in self._workers):
                self._pump(None)
                if time.monotonic() > note + PROGRESS_S:
                    note += PROGRESS_S
                    log.info("reward pool: %d/%d workers ready after %.0f s (loading %s)",
                             sum(w.ready for w in self._workers), workers, time.monotonic() - t0, scorer)
        except BaseException:
            self.close()
            raise
        log.info("reward pool: %d workers ready in %.1f s (%s)", workers, time.monotonic() - t0, scorer)

    def score(self, payloads: list) -> list[float]:
        """The score of every payload, in order; 0.0 (and counted) for those that failed."""
        return self._run(payloads, [0.0] * len(payloads), text=False)

    def call(self, payloads: list) -> list[str | None]:
        """The text a tool returned for every payload, in order; None (and counted) for those that failed."""
        return self._run(payloads, [None] * len(payloads), text=True)

    def _run(self, payloads: list, results: list, text: bool) -> list:
        if self._closed:
            raise RuntimeError("reward pool is closed")
        todo = deque()
        for i, payload in enumerate(payloads):
            data = frame(ScoreRequest(i, payload))
            if len(data) - _HEADER.size > MAX_FRAME_BYTES:
                self._error(f"payload of {len(data)} bytes is over the {MAX_FRAME_BYTES}-byte cap")
            else:
                todo.append((i, data))
        while todo or any(w.job is not None for w in self._workers):
            self._dispatch(todo)
            self._pump(results, text)
        return results

    def close(self) -> None:
        """Stop every worker (idempotent): EOF to all first, so they exit in parallel."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            with contextlib.suppress(OSError):  # already broken: it is exiting anyway
                w.proc.stdin.close()
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self._workers:
            w.stop(max(0.0, deadline - time.monotonic()))
        self._workers = []
        self._sel.close()

    def _spawn(self) -> _Worker:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "DRIFTRL_LAUNCHER_PID": str(os.getpid()),  # die_with_parent in the worker watches us
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # one thread: unshare() needs it (sandbox)
        w = _Worker(self._argv, env)
        self._sel.register(w.fd, selectors.EVENT_READ, w)
        return w

    def _dispatch(self, todo: deque) -> None:
        for w in list(self._workers):
            if not todo:
                return
            if w.ready and w.job is None:
                job, data = todo.popleft()
                try:
                    w.proc.stdin.write(data)
                    w.proc.stdin.flush()
                    w.job, w.deadline = job, time.monotonic() + self.timeout_s  # from the hand-over
                except OSError:  # it died while idle: not this answer's fault, so ask another
                    todo.appendleft((job, data))
                    log.warning("reward worker %d died while idle: replaced", w.proc.pid)
                    self._replace(w, "died")

    def _pump(self, results: list | None, text: bool = False) -> None:
        """One wait on every worker's pipe, until the nearest deadline; then handle overruns."""
        deadline = min((w.deadline for w in self._workers), default=math.inf)
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        for key, _ in self._sel.select(timeout):
            self._on_readable(key.data, results, text)
        now = time.monotonic()
        for w in [w for w in self._workers if w.deadline <= now]:
            self._replace(w, f"did not answer within {START_TIMEOUT_S:.0f} s")
            self.counts[self._timeouts] += 1
            log.warning("reward check timed out after %.1f s: worker %d killed and replaced (%d timeouts so far)",
                        self.timeout_s, w.proc.pid, self.counts[self._timeouts])

    def _on_readable(self, w: _Worker, results, text: bool) -> None:
        if w not in self._workers:
            return  # replaced earlier in this round
        try:
            replies = w.read()
        except (ValueError, msgspec.DecodeError) as e:
            replies = None
            log.warning("reward worker %d broke the protocol (%s)", w.proc.pid, e)
        for reply in replies or []:
            if reply.id == READY:
                if reply.error:
                    raise RuntimeError(f"reward scorer {self.scorer!r} failed to load: {reply.error}")
                w.ready, w.deadline = True, math.inf
            elif reply.id != w.job or results is None:
                log.warning("reward worker %d answered %d out of turn: replaced", w.proc.pid, reply.id)
                replies = None  # the rest of its replies is not trusted either
                break
            else:
                w.job, w.deadline = None, math.inf
                self._take(reply, results, text)
        if replies is None:  # gone or unusable: its answer scores 0 and counts as an error
            self._replace(w, "exited")
            if w.job is not None and results is not None:
                self._error(f"worker {w.proc.pid} died checking an answer (exit status {w.proc.returncode})")

    def _take(self, reply: ScoreReply, results: list, text: bool) -> None:
        is_text = reply.text is not None
        if reply.error or is_text != text:
            self._error(reply.error or ("returned a str, not a score" if is_text else "returned a number, not text"))
        else:
            results[reply.id] = reply.text if text else reply.score
            self.counts[self._checks] += 1

    def _replace(self, w: _Worker, why: str) -> None:
        """Kill (or reap) ``w`` and start another; one that never got ready fails the pool's start."""
        self._sel.unregister(w.fd)
        w.stop()
        if not w.ready:
            raise RuntimeError(f"reward worker for {self.scorer!r} {why} during start-up (exit status "
                               f"{w.proc.returncode}; its stderr is in this process's log)")
        self._workers[self._workers.index(w)] = self._spawn()

    def _error(self, message: str) -> None:
        self.counts[self._errors] += 1
        n = self.counts[self._errors]
        if n <= LOGGED_ERRORS or n % 100 == 0:
            log.warning("reward check failed (%d errors so far): %s", n, message)


class PooledTask(Task):
    """A task whose answers are checked in a :class:`RewardPool`, started on the first check (so
    building a task to sample prompts starts no process); truncated answers score 0 unchecked."""

    scorer = ""  # "module:function"
    _pool: RewardPool | None = None

    @abc.abstractmethod
    def payload(self, prompt: Prompt, text: str) -> dict:
        """What the scorer needs to check ``text`` (the completion before EOS) against
        ``prompt``: JSON-able values only, at most :data:`MAX_FRAME_BYTES` encoded."""

    def reward(self, prompt: Prompt, completion_ids) -> float:
        return self.rewards([(prompt, completion_ids)])[0]

    def rewards(self, items: list[tuple[Prompt, list[int]]]) -> list[float]:
        texts = [self.completion_text(ids) for _, ids in items]
        todo = [i for i, text in enumerate(texts) if text is not None]  # truncated: 0, unchecked
        if not todo:
            return [0.0] * len(items)
        if self._pool is None:  # started on the first check: sampling prompts starts no process
            self._pool = RewardPool(self.scorer, self.cfg.reward_workers, self.cfg.reward_timeout_s)
        scores = dict(zip(todo, self._pool.score([self.payload(items[i][0], texts[i]) for i in todo])))
        return [scores.get(i, 0.0) for i in range(len(items))]

    def metrics(self) -> dict[str, float]:
        return dict.fromkeys(COUNTERS, 0.0) if self._pool is None else dict(self._pool.counts)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def read_request(stream) -> ScoreRequest | None:
    """The next request, None at EOF (the pool closed or its process died)."""
    head = stream.read(_HEADER.size)
    if not head:
        return None
    (n,) = _HEADER.unpack(head)  # struct.error on a torn header
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"request frame of {n} bytes is over the {MAX_FRAME_BYTES}-byte cap")
    body = stream.read(n)
    if len(body) < n:
        raise ValueError(f"torn frame: {len(body)} of {n} bytes")
    return _REQUESTS.decode(body)


def _send(stream, reply: ScoreReply) -> None:
    if len(data := frame(reply)) - _HEADER.size > MAX_FRAME_BYTES:
        data = frame(ScoreReply(reply.id, error=f"a reply of {len(data)} bytes is over the cap"))
    stream.write(data)
    stream.flush()


def _reply(i: int, result) -> ScoreReply:
    if isinstance(result, str):
        return ScoreReply(i, text=result)
    return ScoreReply(i, score) if math.isfinite(score := float(result)) else ScoreReply(i, error=f"score is {score!r}")


class _NoNetwork(socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError("network is off for tools")


def _confine(sandbox: Sandbox) -> None:
    """Cap the address space, write no core file (SIGXCPU's), and leave the network unless allowed: a private
    network namespace (loopback down) where user namespaces are on, else a ``socket.socket`` that raises."""
    resource.setrlimit(resource.RLIMIT_AS, (sandbox.memory_mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not sandbox.network and ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        log.warning("tool sandbox: unshare failed (%s): socket.socket raises instead", os.strerror(ctypes.get_errno()))
        socket.socket = _NoNetwork


def _limit_cpu(cpu_s: float) -> None:
    """RLIMIT_CPU counts the process's whole life: the next call may use ``cpu_s`` (rounded up) more."""
    soft = math.ceil(sum(resource.getrusage(resource.RUSAGE_SELF)[:2])) + math.ceil(cpu_s)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def main(argv=None) -> int:
    """A pool's worker process: it exits at EOF on stdin, and dies with the pool's process."""
    ap = argparse.ArgumentParser(description="A reward-pool worker (started by actor.rewards.RewardPool).")
    ap.add_argument("--scorer", required=True, help="module:function")
    ap.add_argument("--sandbox", type=lambda s: msgspec.json.decode(s, type=Sandbox), help="Sandbox as JSON")
    args = ap.parse_args(argv)
    if args.sandbox is not None:  # while single-threaded (unshare), before the tool's module loads
        _confine(args.sandbox)
    # the protocol's own copies of stdin/stdout; fd 0 becomes /dev/null and fd 1 the log (a checker's print)
    frames_in, frames_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the pool's process to handle
    module_name, _, name = args.scorer.partition(":")
    try:  # the scorer function, after its module's optional warmup(); any failure is the READY reply's
        if not module_name or not name:
            raise ValueError(f"reward scorer {args.scorer!r} is not of the form 'module:function'")
        module = importlib.import_module(module_name)
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ValueError(f"reward scorer {args.scorer!r}: {module_name} has no function {name!r}")
        if callable(getattr(module, "warmup", None)):
            module.warmup()
    except Exception as e:
        _send(frames_out, ScoreReply(READY, error=_describe(e)))
        return 1
    _send(frames_out, ScoreReply(READY))
    while (req := read_request(frames_in)) is not None:
        try:
            if args.sandbox is not None:
                _limit_cpu(args.sandbox.cpu_s)
            reply = _reply(req.id, fn(req.payload))
        except Exception as e:  # this answer scores 0; the worker carries on
            reply = ScoreReply(req.id, error=_describe(e))
        _send(frames_out, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
