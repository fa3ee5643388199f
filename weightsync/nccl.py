"""NCCL transport (across GPUs and hosts): a header over ZeroMQ, then one raw-byte broadcast per bucket (bitwise:
bfloat16 needs no NCCL dtype), bounded by ``collective_timeout_s`` (then aborted). Every rank's communicator is on
*its own* device, never the current one, and a subscriber's ``apply()`` receives every queued version (NCCL needs
every rank in every collective): an actor that stops calling it stalls the learner. ``backend="gloo"``: the same on
CPU tensors (tests); ``"torch_dist"``: inference servers that receive with ``torch.distributed`` (a cupy communicator
cannot share their clique), each joined through a :class:`GroupLink`; a restarted one rebuilds the group."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket as _socket
from typing import Mapping, Union

import msgspec
import torch
import torch.distributed as dist
import zmq
from torch.distributed import distributed_c10d as c10d

from core import net
from core.files import atomic_write, read_json
from core.messages import (SCHEMA_VERSION, CollectiveInit, DeltaHeader, Hello, RankDevice, Shutdown, WeightUpdateHeader,
                           decoder, encode)
from weightsync import delta, layout
from weightsync.base import Publisher, Stopped, Subscriber, SubscriberStats, _Closable, wait_until
from weightsync.files import weights_dir

log = logging.getLogger(__name__)

STOP_POLL_S = 0.1  # how often a blocked join looks at its stop flag
GROUP_NAME = "driftrl_weights"  # the torch_dist group (and PrefixStore) name both sides use
BACKENDS = ("nccl", "gloo", "torch_dist")

_to_subscriber = decoder(Union[CollectiveInit, WeightUpdateHeader, DeltaHeader, Shutdown])
_hello = decoder(Hello)
_rank_device = decoder(RankDevice)


def endpoint_path(run_dir: str) -> str:
    return os.path.join(weights_dir(run_dir), "nccl.json")


class _NcclComm:
    """cupy's NCCL communicator driving torch CUDA buffers through their raw pointers."""

    def __init__(self, world: int, uid: bytes, rank: int, device: torch.device):
        import cupy
        from cupy.cuda import nccl

        self._nccl, self.device = nccl, device
        # cupy >= 14 takes the id as bytes; older releases as a tuple of 128 signed chars
        commid = uid if int(cupy.__version__.split(".")[0]) >= 14 else tuple(b - 256 if b > 127 else b for b in uid)
        with cupy.cuda.Device(device.index):
            self.comm = nccl.NcclCommunicator(world, commid, rank)
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def new_id() -> bytes:
        from cupy.cuda import nccl

        return bytes(b & 0xFF for b in nccl.get_unique_id())  # bytes, or (older cupy) signed chars

    def send(self, bufs: list[torch.Tensor], timeout_s: float, what: str, stopped=None) -> None:
        """Broadcast ``bufs`` from rank 0, each in place; aborted past ``timeout_s`` or once ``stopped``."""
        # packing/unpacking runs on the caller's stream; the broadcasts must come after it
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for buf in bufs:
            self.comm.bcast(buf.data_ptr(), buf.numel(), self._nccl.NCCL_UINT8, 0, self.stream.cuda_stream)
        try:
            wait_until(self.stream.record_event().query, timeout_s, f"the NCCL broadcast of {what}", 1e-4, stopped)
        except (Stopped, TimeoutError):
            self.comm.abort()
            raise
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        self.comm.destroy()


class _GlooComm:
    """The same broadcasts over torch's Gloo process group, on CPU tensors (tests, CPU hosts)."""

    def __init__(self, world: int, uid: bytes, rank: int, timeout_s: float, store=None):
        host, port = uid.decode().rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(host, int(port), world, False, timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout, opts._devices = timeout, [dist.ProcessGroupGloo.create_device(hostname=host)]
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, opts)

    def send(self, bufs: list[torch.Tensor], timeout_s: float, what: str, stopped=None) -> None:
        for buf in bufs:  # bounded by the group's own timeout
            self.pg.broadcast(buf, 0).wait()  # from rank 0

    def close(self) -> None:
        self.pg = None


class _TorchGroup:
    """Rank 0 of the torch_dist group, made by the very call a server's receiver makes, so that both
    derive the same store keys (``TCPStore`` master, ``PrefixStore(GROUP_NAME)``, the private
    ``_new_process_group_helper``): ``init_process_group`` would make the process's *default* group
    and ``new_group`` rendezvouses through the default store, which the servers never see."""

    def __init__(self, store, world: int, backend: str, timeout_s: float):
        # with an eagerly bound default group, torch would split the new NCCL communicator from the
        # learner's own (ncclCommSplit), which the servers' ranks are not part of
        if dist.is_initialized() and c10d._get_default_group().bound_device_id is not None:
            raise ValueError("weightsync.transport=torch_dist: the learner's default process group is bound to a "
                             "device (init_process_group(device_id=...)), so torch would split the servers' group "
                             "from it; initialise the learner's group without device_id")
        self.backend, self.store = backend, store  # the TCPStore master: it must outlive the group
        self.pg, _ = c10d._new_process_group_helper(
            world, 0, [], c10d.Backend(backend), c10d.PrefixStore(GROUP_NAME, store), group_name=GROUP_NAME,
            timeout=datetime.timedelta(seconds=timeout_s))
        c10d._world.pg_group_ranks[self.pg] = {r: r for r in range(world)}  # destroy_process_group reads it

    def send(self, bufs: list[torch.Tensor], timeout_s: float, what: str, stopped=None) -> None:
        # group_src: a rank of this group, whatever the learner's own default group numbers it
        works = [dist.broadcast(buf, group=self.pg, group_src=0, async_op=True) for buf in bufs]
        try:  # a server that never receives stalls every rank
            wait_until(lambda: all(w.is_completed() for w in works), timeout_s,
                       f"the {self.backend} broadcast of {what} to the group", 1e-4, stopped)
        except (Stopped, TimeoutError):
            if self.backend == "nccl":  # a Gloo broadcast cannot be interrupted; its own timeout bounds it
                c10d._abort_process_group(self.pg)
            raise
        for w in works:
            w.wait()  # raises a failed broadcast's error; NCCL: orders the caller's stream after it

    def close(self) -> None:
        if self.pg in c10d._world.pg_map:  # an aborted group is gone already
            dist.destroy_process_group(self.pg)


class NcclPublisher(Publisher):
    """Rank 0: waits (``join_timeout_s``) for ``world_size - 1`` subscribers (torch_dist: servers, once up), refuses
    two ranks on one CUDA device of a host (NCCL: "Duplicate GPU detected", later), then sends each its rank."""

    transport = "nccl"

    def __init__(self, run_dir: str, template: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20, *,
                 world_size: int, host: str = "127.0.0.1", curve: net.Curve | None = None, backend: str = "nccl",
                 join_timeout_s: float = 300, collective_timeout_s: float = 300, stop=None,
                 torch_backend: str = "nccl"):
        super().__init__(layout.header_for(-1, template, bucket_bytes))
        device = next(iter(template.values())).device
        check_backend(backend, torch_backend, device)
        self.backend, self.torch_backend, self.world_size, self._stop = backend, torch_backend, world_size, stop
        self.collective_timeout_s = collective_timeout_s
        self.rank_devices: dict[int, str] = {0: str(device)}  # rank -> device, from each RankDevice
        self.bad_frames = self.rebuilds = 0  # rebuilds: groups rebuilt for a repeat Hello (torch_dist)
        self._bufs, self._views = _buffers(self.header, device, packed=backend == "torch_dist")
        self._ctx = zmq.Context()
        self._sock = net.socket(self._ctx, zmq.ROUTER, linger_ms=1000)
        port = net.bind(self._sock, host, 0, curve)
        self._host = _socket.gethostname() if host in ("0.0.0.0", "::", "*") else host  # as advertised
        self._endpoint = endpoint_path(run_dir)
        os.makedirs(os.path.dirname(self._endpoint), exist_ok=True)
        atomic_write(self._endpoint, json.dumps({"host": self._host, "port": port}).encode())
        self._peers: list[bytes] = []
        self._ids: list[str] = []  # each rank's Hello.id: how a restarted peer is recognised
        try:
            self._gather_peers(join_timeout_s)
            self._comm = self._new_comm(device)
        except BaseException:
            self._close_sockets()
            raise

    @classmethod
    def from_config(cls, cfg, run_dir: str, template: Mapping[str, torch.Tensor], *, stop=None) -> "NcclPublisher":
        backend = "torch_dist" if cfg.weightsync.transport == "torch_dist" else "nccl"
        return cls(run_dir, template, cfg.weightsync.bucket_mb << 20, world_size=1 + cfg.actor.num_actors,
                   host=cfg.net.host, curve=net.curve_from_config(cfg.net), backend=backend,
                   join_timeout_s=cfg.weightsync.join_timeout_s, stop=stop)

    def _gather_peers(self, timeout_s: float) -> None:
        claims = [(_socket.gethostname(), self.rank_devices[0])]
        group = self.backend == "torch_dist"

        def joined() -> bool:
            while len(self._peers) < self.world_size - 1 and self._sock.poll(0):
                frames = self._sock.recv_multipart()
                join = _decode_join(frames, group)
                if join is None:
                    self.bad_frames += 1  # not one of ours, or another schema: count it, keep waiting
                elif frames[0] not in self._peers:
                    self._peers.append(frames[0])
                    self._ids.append(join[0].id)
                    if join[1] is not None:
                        claims.append((join[1].host, join[1].device))
            return len(self._peers) >= self.world_size - 1

        try:
            wait_until(joined, timeout_s, "the subscribers", STOP_POLL_S, self._stop)
        except (Stopped, TimeoutError) as e:
            raise type(e)(f"nccl publisher: {e} ({len(self._peers)} of {self.world_size - 1} subscribers joined)"
                          ) from None
        if group:  # servers claim no device: each picks its own GPU
            return
        self.rank_devices = {rank: device for rank, (_, device) in enumerate(claims)}
        if shared := shared_devices(claims):  # every subscriber is told why
            why = (f"nccl: ranks {shared} share a CUDA device (rank -> device: {self.rank_devices}); NCCL needs "
                   "one device per rank: give each actor its own actor.device, or use cuda_ipc on one GPU")
            for peer in self._peers:
                self._sock.send_multipart([peer, encode(Shutdown(why))])
            raise ValueError(why)

    def _new_comm(self, device: torch.device | None = None):
        """Send every peer its CollectiveInit and make rank 0's communicator (torch_dist: a fresh
        store, its port chosen by the OS, and group; the servers connect once they have the inits)."""
        timeout = datetime.timedelta(seconds=self.collective_timeout_s)
        store = None if self.backend == "nccl" else dist.TCPStore(self._host, 0, self.world_size, True,
                                                                   timeout=timeout, wait_for_workers=False)
        uid = _NcclComm.new_id() if store is None else f"{self._host}:{store.port}".encode()
        for rank, peer in enumerate(self._peers, start=1):
            self._sock.send_multipart([peer, encode(CollectiveInit(rank, self.world_size, self.backend, uid,
                                                                   self.header))])
        if self.backend == "nccl":
            return _NcclComm(self.world_size, uid, 0, device)
        if self.backend == "gloo":
            return _GlooComm(self.world_size, uid, 0, self.collective_timeout_s, store=store)
        return _TorchGroup(store, self.world_size, self.torch_backend, self.collective_timeout_s)

    def _rejoin(self) -> None:
        """torch_dist: a known peer (by socket, or by Hello.id: a restarted actor has a new socket) that said Hello
        again (its server restarted: its rank is gone) gets a new group, and so does every other peer."""
        again = False
        while self._sock.poll(0):
            frames = self._sock.recv_multipart()
            join = _decode_join(frames, True)
            known = join is not None and (frames[0] in self._peers or join[0].id in self._ids)
            if not known:
                self.bad_frames += 1  # a stranger, or a newcomer while every rank is taken
            elif frames[0] not in self._peers:
                self._peers[self._ids.index(join[0].id)] = frames[0]
            again = again or known
        if again:
            self._comm.close()
            self._comm = self._new_comm()
            self.rebuilds += 1

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int:
        if self.backend == "torch_dist":
            self._rejoin()
        for name, view in self._views:
            view.copy_(named[name])
        frame = encode(layout.with_version(self.header, version))
        for peer in self._peers:
            self._sock.send_multipart([peer, frame])
        self._comm.send(self._bufs, self.collective_timeout_s, f"version {version}", self._stop)
        return layout.payload_nbytes(self.header)

    def use_delta(self, full_every: int, cast: torch.dtype | None = None) -> None:
        if self.backend == "torch_dist":
            raise ValueError("torch_dist servers receive whole tensors through their own update API: no deltas")
        super().use_delta(full_every, cast)

    def _write_delta(self, header: DeltaHeader, payload: torch.Tensor) -> int:
        """The header to every peer, then one broadcast of the payload (none when nothing changed)."""
        frame = encode(header)
        for peer in self._peers:
            self._sock.send_multipart([peer, frame])
        if payload.numel():
            self._comm.send([payload], self.collective_timeout_s, f"delta {header.version}", self._stop)
        return payload.numel()

    def _close_sockets(self) -> None:
        for peer in self._peers:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart([peer, encode(Shutdown("publisher closed"))], zmq.NOBLOCK)
        self._sock.close()
        self._ctx.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._endpoint)

    def _close(self) -> None:
        self._comm.close()
        self._close_sockets()


class NcclSubscriber(Subscriber):
    """Rank >= 1. ``device``: this rank's (``actor.device``), claimed to the publisher (buffers: rank_buffer_device)."""

    transport = "nccl"

    def __init__(self, run_dir: str, timeout_s: float = 60, *, curve: net.Curve | None = None,
                 device: torch.device | str | None = None, actor_id: str = "", collective_timeout_s: float = 300,
                 stop=None):
        super().__init__()
        self._stop, self.collective_timeout_s = stop, collective_timeout_s
        self.device = torch.device(device if device is not None else "cpu")
        self._link = GroupLink(run_dir, timeout_s, curve=curve, actor_id=actor_id, stop=stop)
        try:
            init = self._link.join(RankDevice(_socket.gethostname(), str(self.device)))
            self.rank, self.header = init.rank, init.layout
            self._hash, self._payload = layout.layout_hash(self.header), layout.payload_nbytes(self.header)
            self.buffer_device = rank_buffer_device(init.backend, device)
            self._bufs, self._views = _buffers(self.header, self.buffer_device, packed=False)
            self._comm = (_NcclComm(init.world_size, init.unique_id, init.rank, self.buffer_device)
                          if init.backend == "nccl" else
                          _GlooComm(init.world_size, init.unique_id, init.rank, collective_timeout_s))
        except BaseException:
            self._link.close()
            raise

    @classmethod
    def from_config(cls, cfg, run_dir: str, timeout_s: float, *, stop, device, actor_id: str) -> Subscriber:
        return cls(run_dir, timeout_s, curve=net.curve_from_config(cfg.net), device=device, actor_id=actor_id,
                   stop=stop)

    def latest_version(self) -> int:
        return max(self._link.latest_version(), self.stats.last_version)

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        self._link.latest_version()  # queues every header that arrived
        if not (pending := self._link.pending):
            return None
        for header in pending:  # checked before any byte is received into a buffer
            if isinstance(header, WeightUpdateHeader) and layout.layout_hash(header) != self._hash:
                raise layout.LayoutError(f"nccl subscriber: version {header.version} changed the layout")
        layout.check_targets(self.header, named, role="nccl subscriber")
        if all(isinstance(h, WeightUpdateHeader) for h in pending):  # full versions: keep the newest only
            nbytes = self._one(pending[-1], named, times=len(pending))
        else:  # every rank takes part in every broadcast, so no delta is ever missed: apply each in order
            nbytes = sum(self._one(h, named) for h in pending)
        version = pending[-1].version
        pending.clear()
        if self._bufs[0].is_cuda:
            torch.cuda.current_stream(self._bufs[0].device).synchronize()  # honest apply_s
        return version, nbytes

    def _one(self, header, named: Mapping[str, torch.Tensor], times: int = 1) -> int:
        """Receive ``header``'s version into ``named`` (``times`` full ones into the same buffers: the last stays)."""
        if isinstance(header, WeightUpdateHeader):
            self._comm.send(self._bufs * times, self.collective_timeout_s, f"version {header.version}", self._stop)
            for name, view in self._views:
                named[name].copy_(view)
            return self._payload
        dtypes = [layout.torch_dtype(d) for d in self.header.dtypes]
        _, total = delta.segments(header.counts, [layout.ITEMSIZE[d] for d in self.header.dtypes])
        payload = torch.empty(total, dtype=torch.uint8, device=self._bufs[0].device)
        if total:
            self._comm.send([payload], self.collective_timeout_s, f"delta {header.version}", self._stop)
        delta.apply(header, payload, [named[n] for n in self.header.names], dtypes)
        return total

    def _close(self) -> None:
        self._comm.close()
        self._link.close()


class GroupLink(_Closable):
    """A peer's side of the rendezvous and its header queue (``pending``), moving no bytes: inside an
    :class:`NcclSubscriber`, or (``torch_dist``) an engine's whose server receives the broadcasts itself. When a
    peer's server restarts the publisher rebuilds the group and sends every peer a new ``CollectiveInit``:
    ``rejoin`` holds it until the engine's server left the old group."""

    transport = "torch_dist"

    def __init__(self, run_dir: str, timeout_s: float = 60, *, curve: net.Curve | None = None, actor_id: str = "",
                 stop=None):
        path = endpoint_path(run_dir)
        ep = wait_until(lambda: read_json(path), timeout_s,
                        f"the weight publisher's endpoint {path}; is the learner up?", stop=stop)
        self._ctx = zmq.Context()
        self._sock = net.socket(self._ctx, zmq.DEALER, linger_ms=0)
        try:
            net.connect(self._sock, ep["host"], ep["port"], curve)
        except BaseException:
            self.close()
            raise
        self.timeout_s, self._stop = timeout_s, stop
        self.actor_id = actor_id or f"{_socket.gethostname()}:{os.getpid()}"
        self.init: CollectiveInit | None = None
        self.rejoin: CollectiveInit | None = None
        self.pending: list[WeightUpdateHeader | DeltaHeader] = []
        self.stats = SubscriberStats()  # the engine times its pushes here
        self.restarts = 0  # the engine's server restarts

    @classmethod
    def from_config(cls, cfg, run_dir: str, timeout_s: float, *, stop, device, actor_id: str) -> GroupLink:
        # a server says hello once it is up and gets its rank once every peer has: wait as long as the publisher
        return cls(run_dir, max(timeout_s, cfg.weightsync.join_timeout_s), curve=net.curve_from_config(cfg.net),
                   actor_id=actor_id, stop=stop)

    def join(self, claim: RankDevice | None = None) -> CollectiveInit:
        """Say hello (again, after a restart; an NcclSubscriber with its device ``claim``) and wait for a rank
        (RuntimeError if the publisher refused or closed); versions queued for an earlier group are dropped."""
        self.pending.clear()
        self._sock.send_multipart([encode(Hello("weightsync", self.actor_id)), *([encode(claim)] if claim else [])])
        msg = wait_until(lambda: m if isinstance(m := self._recv(), (CollectiveInit, Shutdown)) else None,
                         self.timeout_s, "the learner to assign a rank (it waits until every peer has joined)",
                         STOP_POLL_S, self._stop)
        if isinstance(msg, Shutdown):
            raise RuntimeError(f"the weight publisher refused to start: {msg.reason}")
        self.init, self.rejoin = (msg if claim else _check_group(msg)), None
        return msg

    def _recv(self):
        """One message (queueing a header), or None when none is there."""
        if not self._sock.poll(0):
            return None
        msg = _to_subscriber.decode(self._sock.recv())
        if isinstance(msg, (WeightUpdateHeader, DeltaHeader)):
            self.pending.append(msg)
        elif isinstance(msg, CollectiveInit) and self.init is not None and msg != self.init:
            # a rebuilt group: headers queued before it were broadcast in the old one, which
            # every rank had to finish before the rebuild
            self.pending.clear()
            self.init = self.rejoin = _check_group(msg)
        elif isinstance(msg, Shutdown):
            log.warning("the learner's weight publisher closed: %s", msg.reason)
        return msg

    def latest_version(self) -> int:
        """Queue every header that arrived (non-blocking); the newest queued version, else -1."""
        list(iter(self._recv, None))  # each message until none is waiting
        return self.pending[-1].version if self.pending else -1

    def metrics(self) -> dict[str, float]:  # no bytes and no skipped versions: the engine's pushes set only the times
        return {**Subscriber.metrics(self), "actor/engine_restarts": float(self.restarts)}

    def _close(self) -> None:
        self._sock.close()
        self._ctx.term()


def _check_group(msg: CollectiveInit) -> CollectiveInit:
    if msg.backend != "torch_dist":
        raise ValueError(f"the learner's publisher set up backend={msg.backend!r}, not a torch_dist group a server "
                         "can join: set weightsync.transport=torch_dist")
    if not 1 <= msg.rank < msg.world_size:
        raise ValueError(f"CollectiveInit: rank {msg.rank} outside [1, {msg.world_size})")
    return msg


def _decode_join(frames: list[bytes], group: bool = False) -> tuple[Hello, RankDevice | None] | None:
    """A subscriber's [identity, Hello, RankDevice] frames (a GroupLink's: [identity, Hello]) as
    (its Hello, its device claim or None); None if not that (a stranger, another schema)."""
    if len(frames) != (2 if group else 3):
        return None
    try:
        hello = _hello.decode(frames[1])
        claim = None if group else _rank_device.decode(frames[2])
        torch.device(claim.device if claim else "cpu")
    except (msgspec.DecodeError, RuntimeError, ValueError):  # RuntimeError: not a device string
        return None
    return (hello, claim) if hello.schema_version == SCHEMA_VERSION else None


def check_backend(backend: str, torch_backend: str, device: torch.device) -> None:
    """The publisher's ``backend`` (and ``torch_backend``) against the weights' device: NCCL moves CUDA memory."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch_dist" and torch_backend not in ("nccl", "gloo"):
        raise ValueError(f"torch_backend must be 'nccl' (CUDA) or 'gloo' (CPU tests), got {torch_backend!r}")
    if backend == "torch_dist" and torch_backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the torch_dist group's servers receive over NCCL, which broadcasts CUDA memory, but the "
                         f"learner's weights are on {device}: set learner.device to a CUDA device")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the nccl transport needs CUDA tensors, but the learner's weights are on {device}: "
                         "set learner.device (and actor.device) to CUDA devices, or use weightsync.transport=shm")


def _buffers(header: WeightUpdateHeader, device: torch.device, *, packed: bool):
    """One uint8 buffer per bucket and the (name, view) pairs into them, aligned or packed (torch_dist)."""
    bufs, views = [], []
    for i, b in enumerate(header.buckets):
        bufs.append(torch.empty(layout.packed_nbytes(header, i) if packed else b.nbytes, dtype=torch.uint8,
                                device=device))
        views += layout.views(header, bufs[-1], i, packed=packed).items()
    return bufs, views


def shared_devices(claims: list[tuple[str, str]]) -> list[list[int]]:
    """Groups of ranks (indices into ``claims``: ``(host, device)``) on one CUDA device of a host (CPU may share)."""
    by_device: dict[tuple[str, str], list[int]] = {}
    for rank, (host, device) in enumerate(claims):
        if torch.device(device).type == "cuda":
            by_device.setdefault((host, str(torch.device(device))), []).append(rank)
    return [ranks for ranks in by_device.values() if len(ranks) > 1]


def rank_buffer_device(backend: str, device) -> torch.device:
    """A subscriber's receive buffers: on its own CUDA device under NCCL, the CPU under Gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device(device if device is not None else "cpu")
    if dev.type != "cuda" or dev.index is None:
        raise ValueError(f"the nccl transport needs each actor on its own CUDA device, but this subscriber's "
                         f"actor.device is {device!r}: set actor.device to 'cuda:N' (core/placement.py)")
    return dev
