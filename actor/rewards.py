"""Reward checking in a pool of worker processes, with a per-answer wall-clock timeout.

External checkers can hang or crash on a strange answer and a thread cannot be stopped, so each
answer is checked in a killable process, ``python -m actor.rewards --scorer module:function``,
which runs the checker in its main thread (math-verify's ``signal.alarm`` needs it). Requests and
replies are msgspec Structs in length-prefixed msgpack frames over the worker's stdin/stdout:
nothing is pickled. The first reply is ``Reply(READY)`` once the scorer module and its optional
``warmup()`` are loaded; a scorer that cannot load is a configuration error (the pool raises).

    | what happens                         | the answer | counted           | the worker       |
    |--------------------------------------|------------|-------------------|------------------|
    | the scorer returns a finite number   | that score | ``reward/checks`` | kept             |
    | the scorer raises or returns NaN/inf | 0.0        | ``reward/errors`` | kept             |
    | no reply within ``timeout_s``        | 0.0        | ``reward/timeouts``| killed, replaced |
    | the worker dies (``os._exit``, OOM)  | 0.0        | ``reward/errors`` | replaced         |
    | payload over :data:`MAX_FRAME_BYTES` | 0.0        | ``reward/errors`` | not asked        |

The timeout counts from the hand-over; a replacement's warm-up counts against no one. Workers
run ``die_with_parent`` and exit at EOF on stdin, so none outlives the pool's process.
"""
from __future__ import annotations

import abc
import argparse
import importlib
import logging
import math
import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from typing import Any

import msgspec

from actor.tasks import Prompt, Task

log = logging.getLogger("driftrl.rewards")
READY = -1  # the id of a worker's first reply: loaded (or not)
MAX_FRAME_BYTES = 1 << 20  # one answer's payload; far above a completion's text plus a task item
START_TIMEOUT_S = 120.0  # a worker's import + warmup(); reasoning-gym's takes ~2 s
STOP_GRACE_S = 2.0
PROGRESS_S = 10.0
COUNTERS = ("reward/checks", "reward/timeouts", "reward/errors")
LOGGED_ERRORS = 10  # the first errors are logged with their message, then every 100th
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEADER = struct.Struct("!I")


class Request(msgspec.Struct, array_like=True):
    id: int
    payload: Any


class Reply(msgspec.Struct, array_like=True):
    id: int
    score: float = 0.0
    error: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_REQUESTS = msgspec.msgpack.Decoder(Request)
_REPLIES = msgspec.msgpack.Decoder(Reply)


def frame(msg) -> bytes:
    body = _ENCODER.encode(msg)
    return _HEADER.pack(len(body)) + body


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1000]


def load_scorer(spec: str):
    """The function named by ``"module:function"``, after the module's optional ``warmup()``."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"reward scorer {spec!r} is not of the form 'module:function'")
    module = importlib.import_module(module_name)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward scorer {spec!r}: {module_name} has no function {name!r}")
    if callable(getattr(module, "warmup", None)):
        module.warmup()
    return fn


# ---- the pool (parent side) ------------------------------------------------------------------

class _Worker:
    """One checker process: starting (no READY yet), idle, or busy with answer ``job``."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.fd = self.proc.stdout.fileno()  # kept: still the selector's key after the pipe is closed
        self.buf = bytearray()
        self.ready, self.job = False, None
        self.deadline = time.monotonic() + START_TIMEOUT_S

    def send(self, data: bytes, job: int, timeout_s: float) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()
        self.job, self.deadline = job, time.monotonic() + timeout_s

    def done(self) -> None:
        self.job, self.deadline = None, math.inf

    def read(self) -> list[Reply] | None:
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
            try:
                pipe.close()
            except OSError:  # a dead reader: the unflushed bytes have nowhere to go
                log.debug("reward worker %d: pipe already broken", self.proc.pid)


class RewardPool:
    """``workers`` processes checking answers with ``scorer`` ("module:function": a JSON-able
    payload -> float), each answer within ``timeout_s`` seconds."""

    def __init__(self, scorer: str, workers: int, timeout_s: float):
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"reward pool: workers={workers}, timeout_s={timeout_s}: both must be positive")
        self.scorer, self.timeout_s = scorer, float(timeout_s)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._argv = [sys.executable, "-m", "actor.rewards", "--scorer", scorer]
        self._sel = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._closed = False
        try:
            for _ in range(workers):
                self._workers.append(self._spawn())
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counts.items()}

    def score(self, payloads: list) -> list[float]:
        """The score of every payload, in order; 0.0 (and counted) for those that failed."""
        if self._closed:
            raise RuntimeError("reward pool is closed")
        results = [0.0] * len(payloads)
        todo = deque(self._frames(payloads))
        while todo or any(w.job is not None for w in self._workers):
            self._dispatch(todo)
            self._pump(results)
        return results

    def close(self) -> None:
        """Stop every worker (idempotent): EOF to all first, so they exit in parallel."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.proc.stdin.close()
            except OSError:
                log.debug("reward worker %d: stdin already broken", w.proc.pid)
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self._workers:
            w.stop(max(0.0, deadline - time.monotonic()))
        self._workers = []
        self._sel.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["DRIFTRL_LAUNCHER_PID"] = str(os.getpid())  # die_with_parent in the worker watches us
        w = _Worker(self._argv, env)
        self._sel.register(w.fd, selectors.EVENT_READ, w)
        return w

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        note = t0 + PROGRESS_S
        while not all(w.ready for w in self._workers):
            self._pump(None)
            if time.monotonic() > note:
                note += PROGRESS_S
                log.info("reward pool: %d/%d workers ready after %.0f s (loading %s)",
                         sum(w.ready for w in self._workers), len(self._workers), time.monotonic() - t0, self.scorer)
        log.info("reward pool: %d workers ready in %.1f s (%s)", len(self._workers), time.monotonic() - t0, self.scorer)

    def _frames(self, payloads: list):
        for i, payload in enumerate(payloads):
            data = frame(Request(i, payload))
            if len(data) - _HEADER.size > MAX_FRAME_BYTES:
                self._error(f"payload of {len(data)} bytes is over the {MAX_FRAME_BYTES}-byte cap")
                continue
            yield i, data

    def _dispatch(self, todo: deque) -> None:
        for w in list(self._workers):
            if not todo:
                return
            if w.ready and w.job is None:
                job, data = todo.popleft()
                try:
                    w.send(data, job, self.timeout_s)
                except OSError:  # it died while idle: not this answer's fault, so ask another
                    todo.appendleft((job, data))
                    log.warning("reward worker %d died while idle: replaced", w.proc.pid)
                    self._replace(w)

    def _pump(self, results: list[float] | None) -> None:
        """One wait on every worker's pipe, until the nearest deadline; then handle overruns."""
        deadline = min((w.deadline for w in self._workers), default=math.inf)
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        for key, _ in self._sel.select(timeout):
            self._on_readable(key.data, results)
        self._expire(results)

    def _on_readable(self, w: _Worker, results) -> None:
        if w not in self._workers:
            return  # replaced earlier in this round
        try:
            replies = w.read()
        except (ValueError, msgspec.DecodeError) as e:
            replies = None
            log.warning("reward worker %d broke the protocol (%s)", w.proc.pid, e)
        if replies is None:
            self._lost(w, results)
            return
        for reply in replies:
            if w not in self._workers:
                return  # replaced for a reply out of turn: the rest is not trusted either
            self._on_reply(w, reply, results)

    def _on_reply(self, w: _Worker, reply: Reply, results) -> None:
        if reply.id == READY:
            if reply.error:
                raise RuntimeError(f"reward scorer {self.scorer!r} failed to load: {reply.error}")
            w.ready, w.deadline = True, math.inf
            return
        if reply.id != w.job or results is None:
            log.warning("reward worker %d answered %d out of turn: replaced", w.proc.pid, reply.id)
            self._lost(w, results)
            return
        w.done()
        if reply.error:
            self._error(reply.error)
        else:
            results[reply.id] = reply.score
            self.counts["reward/checks"] += 1

    def _lost(self, w: _Worker, results) -> None:
        """``w`` is gone (or unusable): its answer scores 0 and counts as an error."""
        self._retire(w)  # reaps it: the exit status says why
        if not w.ready:
            raise RuntimeError(f"reward worker for {self.scorer!r} exited during start-up with status "
                               f"{w.proc.returncode} (its stderr is in this process's log)")
        if w.job is not None and results is not None:
            self._error(f"worker {w.proc.pid} died checking an answer (exit status {w.proc.returncode})")
        self._workers[self._workers.index(w)] = self._spawn()

    def _expire(self, results) -> None:
        now = time.monotonic()
        for w in [w for w in self._workers if w.deadline <= now]:
            if not w.ready:
                self._retire(w)
                raise RuntimeError(f"reward worker for {self.scorer!r} did not start within {START_TIMEOUT_S:.0f} s")
            self.counts["reward/timeouts"] += 1
            log.warning("reward check timed out after %.1f s: worker %d killed and replaced (%d timeouts so far)",
                        self.timeout_s, w.proc.pid, self.counts["reward/timeouts"])
            self._replace(w)

    def _replace(self, w: _Worker) -> None:
        self._retire(w)
        self._workers[self._workers.index(w)] = self._spawn()

    def _retire(self, w: _Worker) -> None:
        self._sel.unregister(w.fd)
        w.stop()

    def _error(self, message: str) -> None:
        self.counts["reward/errors"] += 1
        n = self.counts["reward/errors"]
        if n <= LOGGED_ERRORS or n % 100 == 0:
            log.warning("reward check failed (%d errors so far): %s", n, message)


# ---- the task side ---------------------------------------------------------------------------

class PooledTask(Task):
    """A task whose answers are checked in a :class:`RewardPool`, started on the first check (so
    building a task to sample prompts starts no process); truncated answers score 0 unchecked."""

    scorer = ""  # "module:function"

    def __init__(self, cfg_task, tokenizer):
        super().__init__(cfg_task, tokenizer)
        self._pool: RewardPool | None = None

    @abc.abstractmethod
    def payload(self, prompt: Prompt, text: str) -> dict:
        """What the scorer needs to check ``text`` (the completion before EOS) against
        ``prompt``: JSON-able values only, at most :data:`MAX_FRAME_BYTES` encoded."""

    def reward(self, prompt: Prompt, completion_ids) -> float:
        return self.rewards([(prompt, completion_ids)])[0]

    def rewards(self, items: list[tuple[Prompt, list[int]]]) -> list[float]:
        texts = [self.completion_text(ids) for _, ids in items]
        todo = [i for i, text in enumerate(texts) if text is not None]  # truncated: 0, unchecked
        out = [0.0] * len(items)
        if todo:
            scores = self.pool.score([self.payload(items[i][0], texts[i]) for i in todo])
            for i, s in zip(todo, scores):
                out[i] = s
        return out

    @property
    def pool(self) -> RewardPool:
        if self._pool is None:
            self._pool = RewardPool(self.scorer, self.cfg.reward_workers, self.cfg.reward_timeout_s)
        return self._pool

    def metrics(self) -> dict[str, float]:
        return dict.fromkeys(COUNTERS, 0.0) if self._pool is None else self._pool.metrics()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


# ---- the worker (child side) -----------------------------------------------------------------

def _private_stdio():
    """The protocol's own copies of stdin/stdout; fd 0 becomes /dev/null and fd 1 the log."""
    frames_in = os.fdopen(os.dup(0), "rb")
    frames_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return frames_in, frames_out


def read_request(stream) -> Request | None:
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


def check(fn, req: Request) -> Reply:
    """One answer's reply: the score, or the scorer's error (the worker carries on)."""
    try:
        score = float(fn(req.payload))
    except Exception as e:
        return Reply(req.id, error=_describe(e))
    if not math.isfinite(score):
        return Reply(req.id, error=f"non-finite score {score!r}")
    return Reply(req.id, score=score)


def _send(stream, reply: Reply) -> None:
    stream.write(frame(reply))
    stream.flush()


def main(argv=None) -> int:
    from core.proc import die_with_parent

    ap = argparse.ArgumentParser(description="A reward-pool worker (started by actor.rewards.RewardPool).")
    ap.add_argument("--scorer", required=True, help="module:function")
    args = ap.parse_args(argv)
    frames_in, frames_out = _private_stdio()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the pool's process to handle
    t0 = time.monotonic()
    try:
        fn = load_scorer(args.scorer)
    except Exception as e:
        _send(frames_out, Reply(READY, error=_describe(e)))
        return 1
    _send(frames_out, Reply(READY, score=time.monotonic() - t0))
    while (req := read_request(frames_in)) is not None:
        _send(frames_out, check(fn, req))
    return 0


if __name__ == "__main__":
    sys.exit(main())
