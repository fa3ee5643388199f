"""Harness for the buffer's tests and benchmark: configs on free ports, a server in a thread or in
a real subprocess (started and killed by pid, never by name), a bare actor socket that shows every
ack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from buffer.server import BufferServer
from core import config as C
from core import net
from core.messages import BUFFER_TO_ACTOR, Ack, Acks, Hello, decoder, encode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# what tests/support/synth.make_group builds: ids below 32000, completions of at most 1,024
# tokens; group_size 2, the size these tests send (a test of another size says so)
LIMITS = dict(group_size=2, max_new_tokens=1024)
VOCAB = 32000


def make_config(net_overrides: dict | None = None, *, run_dir=None, actor: dict | None = None,
                **buffer_overrides) -> C.Config:
    """Default config with the buffer on two free loopback ports, ``buffer.*`` overridden, the
    limits of :data:`LIMITS` (``actor`` overrides them) and, with ``run_dir``, the run's secret
    created there and ``run.run_dir`` set: every client built from the config presents it, as in
    a launched run."""
    cfg = C.Config()
    n = msgspec.structs.replace(cfg.net, buffer_actor_port=net.free_port(),
                                buffer_learner_port=net.free_port(), **(net_overrides or {}))
    cfg = msgspec.structs.replace(
        cfg, net=n, buffer=msgspec.structs.replace(cfg.buffer, **buffer_overrides),
        actor=msgspec.structs.replace(cfg.actor, **{**LIMITS, **(actor or {})}),
        model=msgspec.structs.replace(cfg.model, vocab_size=VOCAB))
    if run_dir is not None:
        run_dir = str(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        net.create_run_secret(run_dir)
        cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, run_dir=run_dir))
    return cfg


def token(cfg: C.Config) -> str:
    """The secret the run of ``cfg`` expects in a Hello."""
    return net.run_secret(cfg.run.run_dir)


def _check_run_dir(cfg: C.Config, run_dir: str) -> None:
    # the server trusts run_dir/secret, the clients read cfg.run.run_dir's: they must agree
    assert os.path.abspath(cfg.run.run_dir) == os.path.abspath(run_dir), \
        f"make_config(run_dir={run_dir!r}) for a server on that run dir, got {cfg.run.run_dir!r}"


class ServerThread:
    """``with ServerThread(cfg, run_dir) as srv:`` -- a BufferServer serving in a thread."""

    def __init__(self, cfg: C.Config, run_dir: str, metrics=None):
        _check_run_dir(cfg, run_dir)
        self.server = BufferServer(cfg, run_dir, metrics=metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.server.serve_forever, args=(self._stop, 100), daemon=True)

    def __enter__(self) -> BufferServer:
        self._thread.start()
        return self.server

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "buffer server thread did not stop"


class ServerProcess:
    """``python -m buffer.server`` on ``run_dir``; ready once it has published its ports."""

    def __init__(self, cfg: C.Config, run_dir: str, timeout_s: float = 30.0):
        _check_run_dir(cfg, run_dir)
        self.config_path = os.path.join(run_dir, "config.json")
        with open(self.config_path, "wb") as f:
            f.write(C.to_json(cfg))
        ports = os.path.join(run_dir, "buffer", "ports.json")
        if os.path.exists(ports):
            os.unlink(ports)
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "buffer.server", "--config", self.config_path, "--run-dir", run_dir],
            env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(ports):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"buffer server did not start: {self.proc.stderr.read()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        self.proc.wait(10)

    def stop(self) -> str:
        """SIGTERM, wait, and return what it logged."""
        self.kill(signal.SIGTERM)
        return self.proc.stderr.read()


class RawActor:
    """A bare DEALER speaking the wire format, to see every ack the server sends (the acks of one
    ``Acks`` message are returned one by one, in order). With ``actor_id`` it says Hello with the
    run's secret first and checks the answer."""

    def __init__(self, cfg: C.Config, actor_id: str | None = None):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.sock = net.socket(self.ctx, zmq.DEALER)
        net.connect(self.sock, cfg.net.host, cfg.net.buffer_actor_port)
        self.dec = decoder(BUFFER_TO_ACTOR)
        self._queued: list[Ack] = []
        if actor_id is not None:
            ack = self.hello(actor_id)
            assert ack.status == "hello", ack

    def hello(self, actor_id: str) -> Ack:
        """Authenticate this connection as ``actor_id``; returns the answer."""
        self.send(Hello("actor", actor_id, token=token(self.cfg)))
        return self.recv()

    def send(self, msg) -> None:
        self.sock.send(encode(msg) if not isinstance(msg, bytes) else msg)

    def recv(self, timeout_ms: int = 5000) -> Ack:
        if not self._queued:
            assert self.sock.poll(timeout_ms), "no answer from the buffer"
            msg = self.dec.decode(self.sock.recv())
            self._queued = list(msg.acks) if isinstance(msg, Acks) else [msg]
        return self._queued.pop(0)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def wait_for(pred, timeout: float = 10.0, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(every)
