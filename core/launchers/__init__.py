"""The ``Launcher`` seam: start every role, watch them, restart what crashed, stop them all.

:meth:`Launcher.run` is the same for every launcher: prepare the run directory (ports, resolved
config), start the buffer, the learner and the actors, feed the live view from the roles'
metrics files (core/metrics.py: one follower, read at the view's refresh rate and at least once
a second, which also merges them into ``metrics.jsonl``), restart a crashed role (an actor or
the buffer: accepted data survives in the spool and the segment log; the learner: from its
newest checkpoint and journal) up to
``run.max_restarts`` times each, and stop the roles in order when the learner has finished its budget
(learner first, so it checkpoints; then actors; the buffer last, so in-flight acknowledgements
land). A role whose heartbeat file stops moving for ``run.heartbeat_timeout_s`` is hung: it is
SIGKILLed and restarted the same way (core/heartbeat.py). A restart waits an exponential backoff
(``run.restart_backoff_s``) without holding up the watch of the other roles: it is scheduled, and
the loop goes on polling them and feeding the view meanwhile. A launcher implements only how one
role process is started, polled and signalled (and may place the roles first, :meth:`Launcher.prepare`):
one file per launcher, one line in :data:`LAUNCHERS` (``run.launcher`` selects it).

The model must already be resolved (``cfg.model.path`` set): building or locating it is the
caller's job (``run.py``), so this package needs nothing above ``core``.
"""

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
from core.proc import EXIT_CORRUPT_LOG, EXIT_WRITE_FAILED
from core.registry import resolve

log = logging.getLogger("driftrl.launch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Role:
    name: str
    argv: list[str]
    handle: object = None  # the launcher's own handle of the running role (a Popen, ...)
    log_path: str = ""

    @property
    def pid(self) -> int | None:
        return getattr(self.handle, "pid", None)


@dataclass
class RunResult:
    run_dir: str
    returncodes: dict[str, int | None] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    wall_s: float = 0.0
    interrupted: bool = False
    contract: dict = field(default_factory=dict)  # the start-up contract check's report (run.py)


class RoleFailed(RuntimeError):
    """A role exited unexpectedly (or crashed more often than run.max_restarts); ``exit_code`` is
    what ``run.py`` exits with (``core.proc.EXIT_WRITE_FAILED`` when a role could not write)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def new_run_dir(base: str = "runs") -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = os.path.abspath(os.path.join(base, stamp))
    n = 1
    while os.path.exists(path):
        path = os.path.abspath(os.path.join(base, f"{stamp}-{n}"))
        n += 1
    return path


def _point_latest(run_dir: str) -> None:
    link = os.path.join(os.path.dirname(run_dir), "latest")
    tmp = f"{link}.{os.getpid()}"
    with contextlib.suppress(OSError):  # runs/latest is a convenience; no symlinks still runs
        os.symlink(os.path.basename(run_dir), tmp)
        os.replace(tmp, link)


def prepare(cfg: C.Config, run_dir: str | None = None) -> tuple[C.Config, str]:
    """Fill in what the roles must agree on (run_dir, ports) and write ``config.json``."""
    if not cfg.model.path:
        raise ValueError("cfg.model.path is empty: resolve the model before launching (run.py)")
    run_dir = os.path.abspath(run_dir or cfg.run.run_dir or new_run_dir())
    os.makedirs(os.path.join(run_dir, "logs"), mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)  # it holds CURVE keys and weights; also a run dir made before this rule
    os.makedirs(os.path.join(run_dir, METRICS_DIR), mode=0o700, exist_ok=True)  # each role's metrics file
    net.create_run_secret(run_dir)  # every role presents it to the buffer
    host = cfg.net.host
    ports = {k: getattr(cfg.net, k) or net.free_port(host if net.is_loopback(host) else "0.0.0.0")
             for k in ("buffer_actor_port", "buffer_learner_port")}
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, run_dir=run_dir),
                                  net=msgspec.structs.replace(cfg.net, **ports))
    atomic_write(os.path.join(run_dir, "config.json"), C.to_json(cfg), mode=0o600)  # may hold CURVE secrets
    _point_latest(run_dir)
    return cfg, run_dir


def roles(cfg: C.Config, run_dir: str, t0: float | None = None) -> list[Role]:
    """The role processes; ``t0``, the launch time, goes to the learner, whose ``run.max_time_s``
    counts from it, so that a restarted learner does not begin a fresh budget."""
    py = sys.executable
    out = [
        Role("buffer", [py, "-m", "buffer.server", "--config", os.path.join(run_dir, "config.json"),
                        "--run-dir", run_dir]),
        Role("learner", [py, "-m", "learner.loop", "--run-dir", run_dir, *(["--t0", repr(t0)] if t0 else [])]),
    ]
    out += [Role(f"actor{i}", [py, "-m", "actor.worker", "--run-dir", run_dir, "--index", str(i)])
            for i in range(cfg.actor.num_actors)]
    return out


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-n:]).decode(errors="replace")
    except OSError:
        return ""


def _last_line(path: str, level: str = "") -> str:
    """The last unindented log line -- a traceback's exception, not its source excerpt -- (of
    ``level``, e.g. "ERROR": its message only, without the prefix)."""
    lines = [ln for ln in _tail(path, 40).splitlines()
             if ln.strip() and not ln[0].isspace() and (not level or f" {level} " in ln)]
    if not lines:
        return "(nothing in its log)"
    return lines[-1].split(": ", 1)[-1] if level else lines[-1]


def _check_restartable(role: Role, code: int | None, run_dir: str) -> None:
    """RoleFailed for an exit a restart would only repeat: a failed write, a damaged segment log."""
    if code == EXIT_WRITE_FAILED:
        raise RoleFailed(f"{role.name} stopped: {_last_line(role.log_path, 'ERROR')}; "
                         f"resume with `python run.py resume {run_dir}` once it can write", EXIT_WRITE_FAILED)
    if code == EXIT_CORRUPT_LOG:
        raise RoleFailed(f"{role.name} stopped: {_last_line(role.log_path, 'ERROR')}; repair with "
                         f"`python -m buffer.persist --salvage {run_dir}/buffer`, then "
                         f"`python run.py resume {run_dir}`", EXIT_CORRUPT_LOG)


def _cause(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"


HUNG_KILL_WAIT_S = 30.0  # a SIGKILLed role is gone at once; a Ray host may take a moment to tell
WATCH_TICK_S = 0.2  # one turn of the watch loop: roles polled, restarts started, the view fed
FEED_MAX_S = 1.0  # the metrics files are read at least this often (a bench silences the view)


class Launcher(abc.ABC):
    name = ""

    def __init__(self, cfg: C.Config):
        self.cfg = cfg
        self._beats: dict[str, heartbeat.Watch] = {}  # role name -> its heartbeat, launcher clock
        self._due: dict[str, float] = {}  # role name -> when its scheduled restart starts it
        self._next_feed = 0.0  # when the watch loop next reads the metrics files

    # ---- what an implementation provides ------------------------------------------------------

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
        """The run directory and the resolved ``config.json`` (a launcher that places roles on
        other hosts resolves their addresses first)."""
        return prepare(self.cfg, run_dir)

    # ---- shared: start, watch, restart, stop --------------------------------------------------

    def start(self, role: Role, run_dir: str) -> None:
        role.log_path = os.path.join(run_dir, "logs", f"{role.name}.log")
        self.spawn(role, run_dir)
        self._beats[role.name] = heartbeat.started(heartbeat.mtime(run_dir, role.name), time.monotonic())

    def stop_all(self, procs: list[Role], grace_s: float = 20.0) -> None:
        """SIGTERM in the given order, wait, then SIGKILL whatever is left."""
        for role in procs:
            if role.handle is None or self.returncode(role) is not None:
                continue
            self.signal(role, signal.SIGTERM)
            deadline = time.time() + grace_s
            while self.returncode(role) is None and time.time() < deadline:
                time.sleep(0.05)
            if self.returncode(role) is None:
                log.warning("%s did not stop in %.0fs: SIGKILL", role.name, grace_s)
                self.signal(role, signal.SIGKILL)
                while self.returncode(role) is None:
                    time.sleep(0.05)

    def _write_pids(self, run_dir: str, procs: list[Role]) -> None:
        """Every live pid of the run, for operators and for the tests that check nothing is left
        (replaced whole: a reader never meets it half written while a role restarts)."""
        pids = {"launcher": os.getpid(), **{r.name: r.pid for r in procs if r.pid}}
        atomic_write(os.path.join(run_dir, "pids.json"), json.dumps(pids).encode(), durable=False)

    def _restart(self, role: Role, run_dir: str, restarts: collections.Counter, metrics, cause: str = "") -> None:
        """Schedule the restart of a crashed role, at most ``run.max_restarts`` times each: an actor
        or the buffer (accepted data survives in the spool and the segment log), or the learner
        (from its newest intact checkpoint and journal, learner/loop.py), after the backoff. Each
        restart is logged with its cause and counted as ``run/restarts/<role>`` in the metrics. A
        role that could not write what it must (a full disk) is not restarted: it would fail again."""
        code, limit = self.returncode(role), self.cfg.run.max_restarts
        _check_restartable(role, code, run_dir)
        cause = cause or _cause(code)
        if restarts[role.name] >= limit:
            raise RoleFailed(f"{role.name} {cause} after {restarts[role.name]} restarts:\n{_tail(role.log_path)}")
        restarts[role.name] += 1
        delay = heartbeat.backoff_s(self.cfg.run.restart_backoff_s, restarts[role.name])
        log.warning("%s %s (last log line: %s); restarting (%d/%d) in %.1fs", role.name, cause,
                    _last_line(role.log_path), restarts[role.name], limit, delay)
        metrics.emit(-1, {f"run/restarts/{role.name}": float(restarts[role.name])})
        self._due[role.name] = time.monotonic() + delay

    def _start_due(self, role: Role, procs: list[Role], run_dir: str) -> None:
        """Start a role whose restart is scheduled, once its backoff has passed."""
        if time.monotonic() >= self._due[role.name]:
            del self._due[role.name]
            self.start(role, run_dir)
            self._write_pids(run_dir, procs)

    def _hung(self, role: Role, run_dir: str) -> str:
        """The cause, when the role's heartbeat has not moved past its allowance ("" otherwise)."""
        now = time.monotonic()
        w = heartbeat.observe(self._beats[role.name], heartbeat.mtime(run_dir, role.name), now)
        self._beats[role.name] = w
        quiet = heartbeat.hung_for(w, now, self.cfg.run.heartbeat_timeout_s)
        return "" if quiet is None else f"hung: no heartbeat for {quiet:.0f} s"

    def _kill(self, role: Role) -> None:
        self.signal(role, signal.SIGKILL)
        deadline = time.monotonic() + HUNG_KILL_WAIT_S
        while self.returncode(role) is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def _check_role(self, role: Role, learner: Role, run_dir: str, restarts, metrics) -> bool:
        """One role's turn of the watch: restart it if it crashed or hung; True when it is the
        learner and it has finished its budget."""
        code = self.returncode(role)
        cause = self._hung(role, run_dir) if code is None else ""
        if code is None and not cause:
            return False
        if code == 0 and role is learner:
            return True
        if cause:
            self._kill(role)
        self._restart(role, run_dir, restarts, metrics, cause)
        return False

    def _feed(self, monitor, follower) -> None:
        """Read the roles' metrics files into the view at its refresh rate (and at least every
        FEED_MAX_S, so metrics.jsonl keeps up), then redraw it if due."""
        now = time.monotonic()
        if now >= self._next_feed:
            self._next_feed = now + min(self.cfg.monitor.refresh_s, FEED_MAX_S)
            monitor.update(follower.read())
        monitor.refresh()

    def _watch(self, procs: list[Role], run_dir: str, monitor, follower, metrics) -> None:
        """Until the learner finishes its budget: feed the view, restart crashed or hung roles."""
        restarts: collections.Counter = collections.Counter()
        learner = next(r for r in procs if r.name == "learner")
        while True:
            Interrupt.check()
            self._feed(monitor, follower)
            for role in procs:
                if role.name in self._due:
                    self._start_due(role, procs, run_dir)
                elif self._check_role(role, learner, run_dir, restarts, metrics):
                    return
            time.sleep(WATCH_TICK_S)

    def run(self, run_dir: str | None = None, monitor=None, on_ready=None) -> RunResult:
        """Prepare, start, watch until the learner finishes its budget, then stop everything."""
        from core.monitor import Monitor

        t0 = time.time()
        cfg, run_dir = self.prepare(run_dir)
        self.cfg = cfg
        follower = follower_for(cfg, run_dir)
        metrics = MetricsWriter(run_dir, "launcher", "launcher")  # its own records: run/restarts/<role>
        monitor = monitor or Monitor(cfg)
        procs = roles(cfg, run_dir, time.time())
        by_name = {r.name: r for r in procs}
        actors = [r for r in procs if r.name.startswith("actor")]
        result = RunResult(run_dir)
        try:
            for role in procs:
                self.start(role, run_dir)
            self._write_pids(run_dir, procs)
            if on_ready:
                on_ready(run_dir, procs)
            with monitor:
                self._watch(procs, run_dir, monitor, follower, metrics)
                self.stop_all(actors + [by_name["buffer"]])
                monitor.update(read_all(follower))
                monitor.refresh(force=True)
        except KeyboardInterrupt:
            result.interrupted = True
        finally:
            self.stop_all([by_name["learner"], *actors, by_name["buffer"]])
            try:
                metrics.close()
                monitor.update(read_all(follower))
            finally:
                follower.close()
                self.close()
            result.returncodes = {r.name: (self.returncode(r) if r.handle else None) for r in procs}
            result.wall_s = time.time() - t0
            result.summary = monitor.summary()
        return result


class Interrupt:
    """Ctrl-C / SIGTERM for the launcher, made sticky: the handler records the signal before it
    raises KeyboardInterrupt, and the watch loop re-raises it while the record stands. A signal
    that lands while Python runs a finalizer has its KeyboardInterrupt swallowed ("Exception
    ignored in ...") and the run would go on; the record makes the next loop turn stop it."""

    signalled = False

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, cls._handler)

    @classmethod
    def _handler(cls, signum, frame):
        cls.signalled = True
        raise KeyboardInterrupt

    @classmethod
    def check(cls) -> None:
        if cls.signalled:
            raise KeyboardInterrupt


LAUNCHERS = {"local": "core.launchers.local:LocalLauncher", "ray": "core.launchers.ray:RayLauncher"}


def make_launcher(cfg: C.Config) -> Launcher:
    return resolve(LAUNCHERS, cfg.run.launcher, "launcher")(cfg)


def launch(cfg: C.Config, run_dir: str | None = None, monitor=None, on_ready=None) -> RunResult:
    return make_launcher(cfg).run(run_dir, monitor, on_ready)
