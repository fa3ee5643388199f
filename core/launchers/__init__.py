"""The ``Launcher`` seam: start every role, watch them, restart what crashed or hung, stop them all.
:meth:`Launcher.run` is shared (a restart's backoff never holds up the watch of the others; the stop order is learner
first, so it checkpoints, the buffer last, so in-flight acks land); a launcher implements only how one role process is
started, polled and signalled."""

from __future__ import annotations

import abc
import collections
import contextlib
import datetime as _dt
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import msgspec

from core import config as C
from core import heartbeat, net
from core.files import atomic_write
from core.metrics import METRICS_DIR, MetricsWriter, follower_for, read_all
from core.monitor import Monitor
from core.proc import EXIT_CORRUPT_LOG, EXIT_WRITE_FAILED
from core.registry import resolve

log = logging.getLogger("driftrl.launch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HUNG_KILL_WAIT_S = 30.0  # a SIGKILLed role is gone at once; a Ray host may take a moment to tell
WATCH_TICK_S = 0.2  # one turn of the watch loop
FEED_MAX_S = 1.0  # the metrics files are read at least this often (a bench silences the view)
BUFFER_PORTS = ("buffer_actor_port", "buffer_learner_port")


@dataclass
class Role:
    name: str
    argv: list[str]
    handle: object = None  # the launcher's own handle of the running role (a Popen, ...)
    log_path: str = ""


@dataclass
class RunResult:
    run_dir: str
    returncodes: dict[str, int | None] = field(default_factory=dict)
    wall_s: float = 0.0
    interrupted: bool = False


class RoleFailed(RuntimeError):
    """A role exited for good; ``exit_code`` is what ``run.py`` exits with."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def new_run_dir(base: str = "runs", prefix: str = "") -> str:
    """``base/<prefix><UTC timestamp>``, ``-N`` appended while that exists."""
    stamp = prefix + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path, n = os.path.abspath(os.path.join(base, stamp)), 1
    while os.path.exists(path):
        path, n = os.path.abspath(os.path.join(base, f"{stamp}-{n}")), n + 1
    return path


def prepare(cfg: C.Config, run_dir: str | None = None) -> tuple[C.Config, str]:
    """Fill in what the roles must agree on (run_dir, ports) and write ``config.json``."""
    if not cfg.model.path:
        raise ValueError("cfg.model.path is empty: resolve the model before launching (run.py)")
    run_dir = os.path.abspath(run_dir or cfg.run.run_dir or new_run_dir())
    os.makedirs(os.path.join(run_dir, "logs"), mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)  # it holds CURVE keys and weights; also a run dir made before this rule
    os.makedirs(os.path.join(run_dir, METRICS_DIR), mode=0o700, exist_ok=True)
    net.create_run_secret(run_dir)
    ports = {k: getattr(cfg.net, k) or net.free_port(cfg.net.host) for k in BUFFER_PORTS}
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, run_dir=run_dir),
                                  net=msgspec.structs.replace(cfg.net, **ports))
    path = os.path.join(run_dir, "config.json")
    atomic_write(path, C.to_json(cfg), mode=0o600)  # may hold CURVE secrets
    with open(path, "rb") as f:  # read back as every role reads it: one that cannot fails here, not in a role
        if C.from_json(f.read()) != cfg:
            raise C.ConfigError(f"{path} does not read back as the config it was written from")
    link = os.path.join(os.path.dirname(run_dir), "latest")
    with contextlib.suppress(OSError):  # runs/latest is a convenience; no symlinks still runs
        os.symlink(os.path.basename(run_dir), f"{link}.{os.getpid()}")
        os.replace(f"{link}.{os.getpid()}", link)
    return cfg, run_dir


def roles(cfg: C.Config, run_dir: str, t0: float | None = None) -> list[Role]:
    """The role processes; the learner's ``run.max_time_s`` counts from ``t0`` (a restart gets no fresh budget)."""
    py, config_json = sys.executable, os.path.join(run_dir, "config.json")
    return [Role("buffer", [py, "-m", "buffer.server", "--config", config_json, "--run-dir", run_dir]),
            Role("learner", [py, "-m", "learner.loop", "--run-dir", run_dir, *(["--t0", repr(t0)] if t0 else [])]),
            *(Role(f"actor{i}", [py, "-m", "actor.worker", "--run-dir", run_dir, "--index", str(i)])
              for i in range(cfg.actor.num_actors))]


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-n:]).decode(errors="replace")
    except OSError:
        return ""


def _last_line(path: str, level: str = "") -> str:
    """The last unindented log line (a traceback's exception, not its source excerpt); with
    ``level`` (e.g. "ERROR"), the last of that level, its message only."""
    lines = [ln for ln in _tail(path, 40).splitlines()
             if ln.strip() and not ln[0].isspace() and (not level or f" {level} " in ln)]
    if not lines:
        return "(nothing in its log)"
    return lines[-1].split(": ", 1)[-1] if level else lines[-1]


def _cause(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"


class Launcher(abc.ABC):
    name = ""

    def __init__(self, cfg: C.Config):
        self.cfg = cfg
        self._beats: dict[str, heartbeat.Watch] = {}  # role name -> its heartbeat, launcher clock
        self._due: dict[str, float] = {}  # role name -> when its scheduled restart starts it
        self._next_feed = 0.0

    @abc.abstractmethod
    def spawn(self, role: Role, run_dir: str) -> None:
        """Start ``role.argv`` with its output appended to ``role.log_path``; set ``role.handle``."""

    @abc.abstractmethod
    def returncode(self, role: Role) -> int | None:
        """None while the role runs, else its exit code."""

    @abc.abstractmethod
    def signal(self, role: Role, sig: int) -> None:
        """Send ``sig`` to the role (nothing if it is gone)."""

    def close(self) -> None:
        """Release what the launcher itself holds (a cluster connection, ...)."""

    def prepare(self, run_dir: str | None) -> tuple[C.Config, str]:
        """The run directory and ``config.json`` (Ray resolves the roles' addresses first)."""
        return prepare(self.cfg, run_dir)

    def start(self, role: Role, run_dir: str) -> None:
        role.log_path = os.path.join(run_dir, "logs", f"{role.name}.log")
        self.spawn(role, run_dir)
        self._beats[role.name] = heartbeat.Watch(heartbeat.mtime(run_dir, role.name), time.monotonic())

    def _wait(self, role: Role, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.returncode(role) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.returncode(role) is not None

    def stop_all(self, procs: list[Role], grace_s: float = 20.0) -> None:
        """SIGTERM in the given order, wait, then SIGKILL whatever is left (and reap it: bounded)."""
        for role in procs:
            if role.handle is None or self.returncode(role) is not None:
                continue
            self.signal(role, signal.SIGTERM)
            if not self._wait(role, grace_s):
                log.warning("%s did not stop in %.0fs: SIGKILL", role.name, grace_s)
                self.signal(role, signal.SIGKILL)
                if not self._wait(role, HUNG_KILL_WAIT_S):
                    log.error("%s (pid %s) survived SIGKILL for %.0fs", role.name, role.handle.pid, HUNG_KILL_WAIT_S)

    def _write_pids(self, run_dir: str, procs: list[Role]) -> None:
        """Every live pid of the run, for operators and for the tests that check nothing is left."""
        pids = {"launcher": os.getpid(), **{r.name: r.handle.pid for r in procs if r.handle}}
        atomic_write(os.path.join(run_dir, "pids.json"), json.dumps(pids).encode(), durable=False, mode=0o600)

    def _check_role(self, role: Role, run_dir: str, restarts: collections.Counter, metrics) -> bool:
        """Schedule a crashed or hung (then SIGKILLed) role's restart after its backoff, ``run.max_restarts`` times
        at most; not one that could not write or found its store damaged: it would fail again. True: done."""
        code, limit = self.returncode(role), self.cfg.run.max_restarts
        if code is None:
            beats, now = self._beats, time.monotonic()
            w = beats[role.name] = heartbeat.observe(beats[role.name], heartbeat.mtime(run_dir, role.name), now)
            if (quiet := heartbeat.hung_for(w, now, self.cfg.run.heartbeat_timeout_s)) is None:
                return False
            self.signal(role, signal.SIGKILL)
            self._wait(role, HUNG_KILL_WAIT_S)
        elif code == 0 and role.name == "learner":
            return True
        elif code in (EXIT_WRITE_FAILED, EXIT_CORRUPT_LOG):
            fix = "once it can write" if code == EXIT_WRITE_FAILED else "after the repair it names"
            raise RoleFailed(f"{role.name} stopped: {_last_line(role.log_path, 'ERROR')}; resume with "
                             f"`python run.py resume {run_dir}` {fix}", code)
        cause = _cause(code) if code is not None else f"hung: no heartbeat for {quiet:.0f} s"
        if restarts[role.name] >= limit:
            raise RoleFailed(f"{role.name} {cause} after {restarts[role.name]} restarts:\n{_tail(role.log_path)}")
        restarts[role.name] += 1
        delay = heartbeat.backoff_s(self.cfg.run.restart_backoff_s, restarts[role.name])
        log.warning("%s %s (last log line: %s); restarting (%d/%d) in %.1fs", role.name, cause,
                    _last_line(role.log_path), restarts[role.name], limit, delay)
        metrics.emit(-1, {f"run/restarts/{role.name}": float(restarts[role.name])})
        self._due[role.name] = time.monotonic() + delay
        return False

    def _watch(self, procs: list[Role], run_dir: str, monitor, follower, metrics) -> None:
        """Until the learner finishes its budget: feed the view at its refresh rate (at least every
        FEED_MAX_S, so metrics.jsonl keeps up), start due restarts, check every role."""
        restarts: collections.Counter = collections.Counter()
        while True:
            Interrupt.check()
            now = time.monotonic()
            if now >= self._next_feed:
                self._next_feed = now + min(self.cfg.monitor.refresh_s, FEED_MAX_S)
                monitor.update(follower.read())
            monitor.refresh()
            for role in procs:
                if role.name not in self._due:
                    if self._check_role(role, run_dir, restarts, metrics):
                        return
                elif time.monotonic() >= self._due[role.name]:
                    del self._due[role.name]
                    self.start(role, run_dir)
                    self._write_pids(run_dir, procs)
            time.sleep(WATCH_TICK_S)

    def run(self, run_dir: str | None = None, monitor=None, on_ready=None) -> RunResult:
        """Prepare, start, watch until the learner finishes its budget, then stop everything."""
        t0 = time.time()
        self.cfg, run_dir = self.prepare(run_dir)
        follower = follower_for(self.cfg, run_dir)
        metrics = MetricsWriter(run_dir, "launcher", "launcher")  # its own records: run/restarts/<role>
        monitor = monitor or Monitor(self.cfg)
        procs = roles(self.cfg, run_dir, time.time())
        buffer, learner, *actors = procs
        result = RunResult(run_dir)
        Interrupt.deferred = True  # from here a signal is raised only at the checks (not inside a Popen.poll)
        try:
            for role in procs:
                Interrupt.check()
                self.start(role, run_dir)
            self._write_pids(run_dir, procs)
            if on_ready:
                on_ready(run_dir, procs)
            with monitor:
                self._watch(procs, run_dir, monitor, follower, metrics)
                self.stop_all([*actors, buffer])
                monitor.update(read_all(follower))
                monitor.refresh(force=True)
        except KeyboardInterrupt:
            result.interrupted = True
        finally:
            self.stop_all([learner, *actors, buffer])
            try:
                metrics.close()
                monitor.update(read_all(follower))
            finally:
                Interrupt.deferred = False  # every role is stopped and reaped
                follower.close()
                self.close()
            result.returncodes = {r.name: (self.returncode(r) if r.handle else None) for r in procs}
            result.wall_s, result.interrupted = time.time() - t0, result.interrupted or Interrupt.signalled
        return result


class Interrupt:
    """Ctrl-C / SIGTERM made sticky: the handler records the signal before it raises KeyboardInterrupt, and the watch
    loop re-raises it while the record stands (a KeyboardInterrupt raised inside a finalizer is swallowed, and the run
    would go on). While roles run (``deferred``) the handler only records: raised between a Popen.poll's lock and its
    ``try``, it would leave that lock taken, the role unreaped and stop_all waiting on it."""

    signalled = False
    deferred = False

    @classmethod
    def install(cls) -> None:
        cls.deferred = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, cls._handler)

    @classmethod
    def _handler(cls, signum, frame):
        cls.signalled = True
        if not cls.deferred:
            raise KeyboardInterrupt

    @classmethod
    def check(cls) -> None:
        if cls.signalled:
            raise KeyboardInterrupt


LAUNCHERS = {"local": "core.launchers.local:LocalLauncher", "ray": "core.launchers.ray:RayLauncher"}


def make_launcher(cfg: C.Config) -> Launcher:
    return resolve(LAUNCHERS, cfg.run.launcher, "launcher")(cfg)
