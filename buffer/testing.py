"""Harness for the buffer's tests and benchmark: configs on free ports, a server in a thread or in
a real subprocess (started and killed by pid, never by name)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgspec

from buffer.server import BufferServer
from core import config as C
from core import net

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_config(net_overrides: dict | None = None, **buffer_overrides) -> C.Config:
    """Default config with the buffer on two free loopback ports and ``buffer.*`` overridden."""
    cfg = C.Config()
    n = msgspec.structs.replace(cfg.net, buffer_actor_port=net.free_port(),
                                buffer_learner_port=net.free_port(), **(net_overrides or {}))
    return msgspec.structs.replace(cfg, net=n, buffer=msgspec.structs.replace(cfg.buffer, **buffer_overrides))


class ServerThread:
    """``with ServerThread(cfg, run_dir) as srv:`` -- a BufferServer serving in a thread."""

    def __init__(self, cfg: C.Config, run_dir: str, metrics=None):
        self.server = BufferServer(cfg, run_dir, metrics=metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.server.serve_forever, args=(self._stop,), daemon=True)

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
        os.makedirs(run_dir, exist_ok=True)
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
