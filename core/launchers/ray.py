"""Ray launcher: every role a subprocess of a small Ray actor (:class:`RoleHost`), placed by one placement group (a
bundle per role, ``ray.*``); ZeroMQ still carries every trajectory. A role dies with its host, and a host Ray reports
dead counts as the role SIGKILLed (a restart makes a fresh host in the same bundle). Hosts are placed before
``config.json`` is written: off the buffer's node the sockets bind its IP (CURVE required); off the learner's node, no
shared memory (``shm``, ``cuda_ipc``). ``run.run_dir`` and the checkout must be at the same path on every node."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import signal as _signal
import threading
from dataclasses import dataclass

import msgspec

try:  # the optional extra `ray`: the module still imports without it (the seam registry checks it)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:
    ray, _RAY_MISSING = None, e

from core import config as C
from core import net
from core.launchers import BUFFER_PORTS, Launcher, Role, prepare, roles
from core.launchers.local import start_process

log = logging.getLogger("driftrl.launch")
RPC_TIMEOUT_S = 30.0  # one answer of a host actor; a busy 2-core node answers in milliseconds
OBJECT_STORE_BYTES = 100 << 20  # nothing large travels through Ray: trajectories go over ZeroMQ
CLOSE_WAIT_S = 10.0
NODE_LOCAL_TRANSPORTS = ("shm", "cuda_ipc")  # shared memory / CUDA IPC handles: one host only


class RoleHost:
    """Runs one role's process on the node Ray placed it on (``start`` before any other call)."""

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}

    def free_ports(self, host: str, n: int) -> list[int]:
        return [net.free_port(host) for _ in range(n)]

    def start(self, argv: list[str], log_path: str, extra_env: dict[str, str]) -> int:
        self.proc = start_process(argv, log_path, extra_env)  # its DRIFTRL_LAUNCHER_PID: this host's pid
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)


RemoteHost = ray.remote(RoleHost) if ray is not None else None


@dataclass
class RayRole:  # Role.handle under Ray
    pid: int
    host: object
    code: int | None = None


def bundles(cfg: C.Config) -> list[dict[str, float]]:
    """One placement-group bundle per role, in ``roles()`` order: buffer, learner, actors."""
    r = cfg.ray
    asks = [(r.buffer_cpus, 0.0, r.buffer_resources), (r.learner_cpus, r.learner_gpus, r.learner_resources)]
    asks += [(r.actor_cpus, r.actor_gpus, r.actor_resources)] * cfg.actor.num_actors
    return [{"CPU": cpus, **({"GPU": gpus} if gpus else {}), **custom} for cpus, gpus, custom in asks]


def local_resources(bs: list[dict[str, float]]) -> dict:
    """What a local instance must offer so every bundle fits on it (Ray's CPUs are logical)."""
    total = sum((collections.Counter(b) for b in bs), collections.Counter())  # every amount is > 0
    gpus = total.pop("GPU", 0.0)
    return {"num_cpus": math.ceil(total.pop("CPU")), "num_gpus": math.ceil(gpus) if gpus else None,
            "resources": dict(total)}


def check_placement(cfg: C.Config, places: dict[str, dict]) -> None:
    learner = places["learner"]["node_id"]
    apart = sorted(n for n, p in places.items() if p["node_id"] != learner)
    if apart and cfg.weightsync.transport in NODE_LOCAL_TRANSPORTS:
        raise C.ConfigError(f"{', '.join(apart)} placed on another node than the learner: "
                            f"`$.weightsync.transport` = {cfg.weightsync.transport!r} works on one node only; "
                            "use 'filesystem' (with a run_dir every node sees) or 'nccl'")


def bind_host(cfg: C.Config, places: dict[str, dict]) -> str:
    """``net.host`` while every role is on the buffer's node or it is routable; else the buffer node's IP."""
    one_node = all(p["node_id"] == places["buffer"]["node_id"] for p in places.values())
    return cfg.net.host if one_node or not net.is_loopback(cfg.net.host) else places["buffer"]["ip"]


def resolve_net(cfg: C.Config, places: dict[str, dict], ports: list[int]) -> C.Config:
    """:func:`bind_host`, and ``ports`` (free on the buffer's node) where the config left 0."""
    host = bind_host(cfg, places)
    filled = {k: getattr(cfg.net, k) or port for k, port in zip(BUFFER_PORTS, ports)}
    out = msgspec.structs.replace(cfg, net=msgspec.structs.replace(cfg.net, host=host, **filled))
    C.validate(out)
    return out


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, cfg: C.Config):
        if ray is None:
            raise ImportError(f"`$.run.launcher` = 'ray' needs Ray: pip install -e '.[ray]' ({_RAY_MISSING})")
        super().__init__(cfg)
        self._started_ray = False
        self._pg = None
        self._hosts: dict[str, object] = {}  # role name -> its live host actor
        self._bundle: dict[str, int] = {}  # role name -> its bundle index

    def _init_ray(self, bs: list[dict[str, float]]) -> None:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # a role outlives its host actor by its parent-death SIGTERM, not Ray's SIGKILL of the
        # worker's children: it stops cleanly (its /dev/shm weights go with it) when the launcher dies
        os.environ.setdefault("RAY_kill_child_processes_on_worker_exit", "0")
        local = {} if self.cfg.ray.address else dict(object_store_memory=OBJECT_STORE_BYTES, **local_resources(bs))
        # ray.init replaces SIGTERM's handler with sys.exit: the launcher's own (Interrupt) must stay
        handlers = {s: _signal.getsignal(s) for s in (_signal.SIGINT, _signal.SIGTERM)}
        try:
            ray.init(address=self.cfg.ray.address or None, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=False, configure_logging=True, **local)
        finally:
            if threading.current_thread() is threading.main_thread():  # (ray.init only sets it there too)
                for s, h in handlers.items():
                    if h is not None:
                        _signal.signal(s, h)
        self._started_ray = True

    def _host(self, name: str):  # a fresh host actor in the role's bundle when it has none
        if name not in self._hosts:
            i = self._bundle[name]
            b = bundles(self.cfg)[i]
            cpus, gpus = b.pop("CPU"), b.pop("GPU", 0)  # the rest: custom resources
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=i)
            self._hosts[name] = RemoteHost.options(num_cpus=cpus, num_gpus=gpus, resources=b,
                                                   scheduling_strategy=strategy, name=None, max_restarts=0).remote()
        return self._hosts[name]

    def _call(self, name: str, method: str, *args, timeout_s: float = RPC_TIMEOUT_S):
        return ray.get(getattr(self._host(name), method).remote(*args), timeout=timeout_s)

    def _where(self, name: str) -> dict:  # the first answer waits for the host's worker to start
        return self._call(name, "where", timeout_s=self.cfg.ray.start_timeout_s)

    def prepare(self, run_dir: str | None) -> tuple[C.Config, str]:
        """Place every role's host (a bundle each, in roles() order), then resolve addresses from where they are."""
        bs, timeout_s = bundles(self.cfg), self.cfg.ray.start_timeout_s
        try:
            self._init_ray(bs)
            self._pg = ray.util.placement_group(bs, strategy=self.cfg.ray.placement_strategy)
            try:
                ray.get(self._pg.ready(), timeout=timeout_s)
            except GetTimeoutError:
                raise RuntimeError(f"Ray could not place the roles' bundles {bs} within {timeout_s:.0f}s "
                                   f"(`$.ray.start_timeout_s`); the cluster has {ray.available_resources()}: "
                                   "lower `$.ray.*_cpus`/`*_gpus` or add nodes") from None
            self._bundle = {r.name: i for i, r in enumerate(roles(self.cfg, run_dir or ""))}
            places = {name: self._where(name) for name in self._bundle}
            check_placement(self.cfg, places)
            ports = self._call("buffer", "free_ports", bind_host(self.cfg, places), len(BUFFER_PORTS))
            return prepare(resolve_net(self.cfg, places, ports), run_dir)
        except BaseException:
            self.close()
            raise

    def spawn(self, role: Role, run_dir: str) -> None:
        extra = {k: v for k, v in os.environ.items() if k.startswith("DRIFTRL_") and k != "DRIFTRL_LAUNCHER_PID"}
        self._where(role.name)  # waits (start_timeout_s) for a fresh host's worker to start
        pid = self._call(role.name, "start", role.argv, role.log_path, extra)
        role.handle = RayRole(pid, self._hosts[role.name])

    def returncode(self, role: Role) -> int | None:
        h = role.handle
        if h.code is None:
            try:
                h.code = ray.get(h.host.poll.remote(), timeout=RPC_TIMEOUT_S)
            except RayActorError:  # the host (and with it the role) is gone: as if SIGKILLed
                h.code = -_signal.SIGKILL
                if self._hosts.get(role.name) is h.host:
                    del self._hosts[role.name]
            except GetTimeoutError:
                log.warning("%s: its Ray host did not answer in %.0fs", role.name, RPC_TIMEOUT_S)
        return h.code

    def signal(self, role: Role, sig: int) -> None:
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(role.handle.host.signal.remote(sig), timeout=RPC_TIMEOUT_S)

    def close(self) -> None:
        # removing the placement group never returns once the cluster's GCS is gone: wait CLOSE_WAIT_S
        # at most (a group left behind goes with the job: it is not detached)
        if self._pg is not None:
            def remove(pg=self._pg):
                with contextlib.suppress(Exception):  # the cluster may already be gone
                    ray.util.remove_placement_group(pg)

            self._pg = None
            t = threading.Thread(target=remove, name="ray-remove-pg", daemon=True)
            t.start()
            t.join(CLOSE_WAIT_S)
            if t.is_alive():
                log.warning("Ray did not remove the placement group in %.0fs (is the cluster gone?)", CLOSE_WAIT_S)
        self._hosts.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
