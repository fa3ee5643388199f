"""NCCL transport (across GPUs and hosts): a header over ZeroMQ, then bucketed broadcasts.

Rendezvous, once:

1. The publisher (rank 0, the learner) binds a ROUTER on ``net.host`` (CURVE when not loopback,
   see core.net) and writes ``run_dir/weights/nccl.json`` = ``{"host", "port"}`` atomically
   (across hosts ``run_dir`` must be on a shared filesystem).
2. Each subscriber (an actor) waits for that file, connects a DEALER and sends ``Hello`` with
   :class:`RankDevice`: the host and the device its rank will use (its ``actor.device``).
3. When ``world_size - 1`` subscribers have said hello, the publisher checks that no two ranks
   claim one CUDA device of one host (NCCL would fail later with "Duplicate GPU detected";
   here the error names the ranks and their devices), answers each with
   :class:`CollectiveInit` (its rank, the NCCL unique id, the layout), and every rank creates
   the communicator on *its own* device (``cupy.cuda.nccl.NcclCommunicator(world, uid, rank)``
   under ``cupy.cuda.Device(index)``, a collective call). No rank ever falls back to the
   current device: two actors on one host would both land on ``cuda:0``.

Per version: the publisher packs the tensors into one flat device buffer per bucket (buckets
hold one dtype each, layout.plan), sends the ``WeightUpdateHeader`` to every subscriber, and
broadcasts each bucket from rank 0 as raw bytes (``NCCL_UINT8``: a broadcast is bitwise, so
bfloat16 needs no NCCL dtype support) on a side stream, then waits for completion -- bounded by
``collective_timeout_s``, after which the communicator is aborted and a TimeoutError names why.

A subscriber's ``latest_version()`` is a non-blocking socket poll that queues headers.
``apply()`` runs the broadcasts of *every* queued header in order -- NCCL needs every rank in
every collective, so a version can be skipped only after it has been received -- and copies the
newest into the targets. Hence the publisher blocks until each actor reaches its next decode
step boundary; an actor that stops calling ``latest_version()``/``apply()`` stalls the learner.

Every wait has a deadline (``join_timeout_s``, ``timeout_s``, ``collective_timeout_s``) and
honours ``stop`` (see weightsync.base.wait_until): the joins poll it every :data:`STOP_POLL_S`
and raise ``Stopped``; an NCCL broadcast in flight is aborted when it is set. (A Gloo broadcast
cannot be interrupted; its own timeout bounds it.)

Every message is msgspec (core.messages.encode); nothing is pickled. cupy is imported lazily.
``backend="gloo"`` runs the identical protocol over torch's Gloo process group on CPU tensors:
that is how the CPU test suite exercises this module without GPUs.

``backend="sglang"``: the subscribers are SGLang servers (actor/engines/sglang.py), which receive
with ``torch.distributed``, not cupy -- a cupy communicator and a torch process group cannot share
one NCCL clique -- so rank 0 joins the group the way SGLang 0.5.23's ``init_weights_update_group``
builds its side (``utils/common.py: init_custom_process_group``): a ``TCPStore`` on
``host:port`` (rank 0 is its master), ``PrefixStore(SGLANG_GROUP)``, then
``_new_process_group_helper`` under the group name :data:`SGLANG_GROUP`. Each ``SGLangLink`` says
``Hello`` (no ``RankDevice``: the server picks its GPU, so the shared-device check cannot run)
and gets ``CollectiveInit(rank, world_size, "sglang", b"host:port", layout)``; its server then
joins with ``rank_offset=rank`` (one rank per server: tensor parallelism 1). Per version: the
header, then for each bucket in order one broadcast of its tensors packed back to back as uint8
with no padding (:func:`packed_views`; SGLang's ``FlattenedTensorBucket``, not layout.views'
aligned offsets). A repeat ``Hello`` (a restarted server: its old rank is gone) rebuilds the group
before the next version: every peer gets a new ``CollectiveInit`` and must join again.
``torch_backend`` is the group's torch backend: ``"nccl"`` on CUDA tensors, ``"gloo"`` on CPU --
the CPU tests run this identical code path.
"""

from __future__ import annotations

import datetime
import json
import os
import socket as _socket
import time
from collections import deque
from typing import Mapping, Union

import msgspec
import torch
import zmq

from core import net
from core.messages import SCHEMA_VERSION, Hello, Shutdown, WeightUpdateHeader, decoder, encode
from weightsync import layout
from core.files import atomic_write, read_json
from weightsync.base import Publisher, Stopped, Subscriber, stop_check, wait_until
from weightsync.files import weights_dir

STOP_POLL_S = 0.1  # how often a blocked join looks at its stop flag
SGLANG_GROUP = "driftrl_weights"  # the group (and PrefixStore) name both sides of backend="sglang" use
BACKENDS = ("nccl", "gloo", "sglang")


class RankDevice(msgspec.Struct, frozen=True, array_like=True, tag="ws_device"):
    # subscriber -> publisher, after its Hello: where its rank computes
    host: str
    device: str  # "cpu" | "cuda:N"


class CollectiveInit(msgspec.Struct, frozen=True, array_like=True, tag="ws_init"):
    # publisher -> one subscriber, once: its place in the communicator
    rank: int
    world_size: int
    backend: str  # "nccl" | "gloo" | "sglang"
    unique_id: bytes  # NCCL unique id (128 B) or b"host:port" of the Gloo / torch.distributed store
    layout: WeightUpdateHeader  # version -1


TO_SUBSCRIBER = Union[CollectiveInit, WeightUpdateHeader, Shutdown]
_to_subscriber = decoder(TO_SUBSCRIBER)
_hello = decoder(Hello)
_rank_device = decoder(RankDevice)


def endpoint_path(run_dir: str) -> str:
    return os.path.join(weights_dir(run_dir), "nccl.json")


# ---- collectives ----------------------------------------------------------------------------


class _NcclComm:
    """cupy's NCCL communicator driving torch CUDA buffers through their raw pointers."""

    def __init__(self, world: int, uid: bytes, rank: int, device: torch.device):
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.device = device
        # cupy >= 14 takes the id as bytes; older releases as a tuple of 128 signed chars
        commid = uid if int(cupy.__version__.split(".")[0]) >= 14 else tuple(b - 256 if b > 127 else b for b in uid)
        with cupy.cuda.Device(device.index):
            self.comm = nccl.NcclCommunicator(world, commid, rank)
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def new_id() -> bytes:
        from cupy.cuda import nccl

        uid = nccl.get_unique_id()
        return bytes(uid) if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)

    def begin(self) -> None:
        # packing/unpacking runs on the caller's stream; the broadcasts must come after it
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def bcast(self, buf: torch.Tensor) -> None:
        self.comm.bcast(buf.data_ptr(), buf.numel(), self._nccl.NCCL_UINT8, 0, self.stream.cuda_stream)

    def end(self, timeout_s: float, what: str, stopped=lambda: False) -> None:
        event = self.stream.record_event()
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if stopped():
                self.comm.abort()
                raise Stopped(f"stopped during the NCCL broadcast of {what}; aborted")
            if time.monotonic() > deadline:
                self.comm.abort()
                raise TimeoutError(f"NCCL broadcast of {what} did not complete in {timeout_s:.0f}s; aborted")
            time.sleep(1e-4)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        self.comm.destroy()


class _GlooComm:
    """The same broadcasts over torch's Gloo process group, on CPU tensors (tests, CPU hosts)."""

    def __init__(self, world: int, uid: bytes, rank: int, timeout_s: float, store=None):
        import torch.distributed as dist

        host, port = uid.decode().rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(host, int(port), world, False, timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, opts)
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    @staticmethod
    def new_store(host: str, world: int, timeout_s: float):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, world, True, timeout=timeout, wait_for_workers=False)
        return store, f"{host}:{store.port}".encode()

    def begin(self) -> None:
        pass

    def bcast(self, buf: torch.Tensor) -> None:
        self.pg.broadcast([buf], self._opts).wait()

    def end(self, timeout_s: float, what: str, stopped=lambda: False) -> None:
        pass

    def close(self) -> None:
        self.pg = None


class _TorchGroup:
    """Rank 0 of the torch.distributed group SGLang's servers join (backend="sglang"). Built
    with ``_new_process_group_helper``, private but the very call SGLang's receiver makes (so both
    sides derive the same store keys), because the public constructors do not fit a one-off group
    with outside ranks: ``init_process_group`` makes the process's *default* group (the learner's
    own, when it has one) and ``new_group`` rendezvouses through the default group's store, which
    SGLang never sees."""

    def __init__(self, store, world: int, backend: str, timeout_s: float):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

        _refuse_split_source(dist)
        self._dist, self.backend = dist, backend
        self.store = store  # the TCPStore master: it must outlive the group
        self.pg, _ = _new_process_group_helper(
            world, 0, [], Backend(backend), PrefixStore(SGLANG_GROUP, store), group_name=SGLANG_GROUP,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        _world.pg_group_ranks[self.pg] = {r: r for r in range(world)}  # destroy_process_group reads it
        self._works: list = []

    def begin(self) -> None:
        self._works = []

    def bcast(self, buf: torch.Tensor) -> None:
        # group_src: a rank of this group, whatever the learner's own default group numbers it
        self._works.append(self._dist.broadcast(buf, group=self.pg, group_src=0, async_op=True))

    def end(self, timeout_s: float, what: str, stopped=lambda: False) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(w.is_completed() for w in self._works):
            if stopped():
                self._abort()
                raise Stopped(f"stopped during the {self.backend} broadcast of {what} to SGLang")
            if time.monotonic() > deadline:
                self._abort()
                raise TimeoutError(f"{self.backend} broadcast of {what} to SGLang did not complete in "
                                   f"{timeout_s:.0f}s (a server that never receives it stalls every rank)")
            time.sleep(1e-4)
        for w in self._works:
            w.wait()  # raises a failed broadcast's error; NCCL: orders the caller's stream after it

    def _abort(self) -> None:
        if self.backend == "nccl":  # a Gloo broadcast cannot be interrupted; its own timeout bounds it
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group(self.pg)

    def close(self) -> None:
        from torch.distributed.distributed_c10d import _world

        if self.pg in _world.pg_map:  # an aborted group is gone already
            self._dist.destroy_process_group(self.pg)


def _refuse_split_source(dist) -> None:
    """With an eagerly bound default group, torch would build the new NCCL communicator by
    splitting the learner's own (``ncclCommSplit``), which SGLang's ranks are not part of."""
    if dist.is_initialized() and dist.distributed_c10d._get_default_group().bound_device_id is not None:
        raise ValueError("weightsync backend='sglang': the learner's default process group is bound to a device "
                         "(init_process_group(device_id=...)), so torch would split SGLang's group from it; "
                         "initialise the learner's group without device_id")


# ---- publisher ------------------------------------------------------------------------------


class NcclPublisher(Publisher):
    """Rank 0. Blocks in the constructor until ``world_size - 1`` subscribers have joined
    (at most ``join_timeout_s``; ``stop`` set: :class:`Stopped`)."""

    transport = "nccl"

    def __init__(
        self, run_dir: str, template: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20, *,
        world_size: int, host: str = "127.0.0.1", curve: net.Curve | None = None,
        backend: str = "nccl", join_timeout_s: float = 300, collective_timeout_s: float = 300, stop=None,
        torch_backend: str = "nccl",
    ):
        super().__init__(layout.header_for(-1, template, bucket_bytes))
        self._stopped = stop_check(stop)
        device = next(iter(template.values())).device
        check_backend(backend, torch_backend, device)
        self.backend, self.torch_backend = backend, torch_backend
        self.host = _socket.gethostname()
        self.rank_devices: dict[int, str] = {0: str(device)}  # rank -> device, from each RankDevice
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.bad_frames = 0
        self.rebuilds = 0  # groups rebuilt for a repeat Hello (backend="sglang")
        self._payload = layout.payload_nbytes(self.header)
        self._bufs, self._views = _buffers(self.header, device, packed=backend == "sglang")

        self._ctx = zmq.Context()
        self._sock = net.socket(self._ctx, zmq.ROUTER, linger_ms=1000)
        port = net.bind(self._sock, host, 0, curve)
        advertised = _socket.gethostname() if host in ("0.0.0.0", "::", "*") else host
        self._endpoint = endpoint_path(run_dir)
        os.makedirs(os.path.dirname(self._endpoint), exist_ok=True)
        atomic_write(self._endpoint, json.dumps({"host": advertised, "port": port}).encode())
        self._advertised = advertised
        try:
            self._peers = self._gather_peers(join_timeout_s)
            self._check_devices()
            self._comm = self._init_comm(backend, advertised, device)
        except BaseException:
            self._close_sockets()
            raise

    @classmethod
    def from_config(cls, cfg, run_dir: str, template: Mapping[str, torch.Tensor], *, stop=None) -> "NcclPublisher":
        """Rank 0 for the run's actors. With ``actor.engine=sglang`` the subscribers are SGLang
        servers receiving by torch.distributed (``backend="sglang"``); each says hello only once its
        server is healthy, so the wait for them covers its start."""
        kw = {"world_size": 1 + cfg.actor.num_actors, "host": cfg.net.host, "curve": net.curve_from_config(cfg.net),
              "stop": stop}
        if cfg.actor.engine == "sglang":
            kw.update(backend="sglang", join_timeout_s=300 + cfg.actor.sglang.start_timeout_s)
        return cls(run_dir, template, cfg.weightsync.bucket_mb << 20, **kw)

    def _gather_peers(self, timeout_s: float) -> list[bytes]:
        peers: list[bytes] = []
        self._claims: list[RankDevice | None] = []
        self._ids: list[str] = []  # each rank's Hello.id: how a restarted peer is recognised
        deadline = time.monotonic() + timeout_s
        while len(peers) < self.world_size - 1:
            left = deadline - time.monotonic()
            if self._stopped():
                raise Stopped(f"nccl publisher: stopped with {len(peers)} of {self.world_size - 1} subscribers joined")
            if left <= 0:
                raise TimeoutError(
                    f"nccl publisher: {len(peers)} of {self.world_size - 1} subscribers joined in {timeout_s:.0f}s"
                )
            if not self._sock.poll(int(min(left, STOP_POLL_S) * 1000) + 1):
                continue
            frames = self._sock.recv_multipart()
            sglang = self.backend == "sglang"
            join = _decode_sglang_hello(frames) if sglang else _decode_join(frames)
            if join is None:
                self.bad_frames += 1  # not one of ours, or another schema: count it, keep waiting
                continue
            if frames[0] not in peers:
                peers.append(frames[0])
                self._ids.append(join.id if sglang else "")
                self._claims.append(None if sglang else join)
        return peers

    def _check_devices(self) -> None:
        """Ranks by device; refuse (telling every subscriber why) two ranks on one CUDA device.
        SGLang servers claim none (each picks its GPU from its own --base-gpu-id)."""
        if self.backend == "sglang":
            return
        claims = [(self.host, self.rank_devices[0]), *((c.host, c.device) for c in self._claims)]
        self.rank_devices = {rank: device for rank, (_, device) in enumerate(claims)}
        shared = shared_devices(claims)
        if shared:
            why = (f"nccl: ranks {shared} share a CUDA device (rank -> device: {self.rank_devices}); NCCL needs "
                   "one device per rank: give each actor its own actor.device, or use cuda_ipc on one GPU")
            for peer in self._peers:
                self._sock.send_multipart([peer, encode(Shutdown(why))])
            raise ValueError(why)

    def _init_comm(self, backend: str, host: str, device: torch.device):
        if backend == "sglang":
            return self._sglang_group()
        store = None
        if backend == "nccl":
            uid = _NcclComm.new_id()
        else:
            store, uid = _GlooComm.new_store(host, self.world_size, self.collective_timeout_s)
        self._send_inits(backend, uid)
        if backend == "nccl":
            return _NcclComm(self.world_size, uid, 0, device)
        return _GlooComm(self.world_size, uid, 0, self.collective_timeout_s, store=store)

    def _send_inits(self, backend: str, uid: bytes) -> None:
        for rank, peer in enumerate(self._peers, start=1):
            init = CollectiveInit(rank, self.world_size, backend, uid, self.header)
            self._sock.send_multipart([peer, encode(init)])

    def _sglang_group(self) -> _TorchGroup:
        """A fresh store (port chosen by the OS, so no race for a free one) and group. The
        CollectiveInits go out before joining: the servers' ranks connect only once they have
        them, and a Gloo group is built only when every rank is there (NCCL: at the first
        broadcast), bounded by ``collective_timeout_s``."""
        store, addr = _GlooComm.new_store(self._advertised, self.world_size, self.collective_timeout_s)
        self._send_inits("sglang", addr)
        return _TorchGroup(store, self.world_size, self.torch_backend, self.collective_timeout_s)

    def _rejoin(self) -> None:
        """A peer that said Hello again (its SGLang server restarted, so its old rank is gone)
        gets a new group, and so does every other peer: a group needs all its ranks."""
        if not self._repeat_hellos():
            return
        self._comm.close()
        self._comm = self._sglang_group()
        self.rebuilds += 1

    def _repeat_hellos(self) -> bool:
        """Take every queued frame (non-blocking); True if a known peer said Hello again. A peer
        is known by its socket or by its Hello.id (a restarted actor has a new socket)."""
        again = False
        while self._sock.poll(0):
            frames = self._sock.recv_multipart()
            hello = _decode_sglang_hello(frames)
            if hello is not None and frames[0] in self._peers:
                again = True
            elif hello is not None and hello.id in self._ids:
                self._peers[self._ids.index(hello.id)] = frames[0]
                again = True
            else:
                self.bad_frames += 1  # a stranger, or a newcomer while every rank is taken
        return again

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int:
        if self.backend == "sglang":
            self._rejoin()
        for views in self._views:
            for name, view in views:
                view.copy_(named[name])
        frame = encode(layout.with_version(self.header, version))
        for peer in self._peers:
            self._sock.send_multipart([peer, frame])
        self._comm.begin()
        for buf in self._bufs:
            self._comm.bcast(buf)
        self._comm.end(self.collective_timeout_s, f"version {version}", self._stopped)
        return self._payload

    def _close_sockets(self) -> None:
        for peer in getattr(self, "_peers", []):
            try:
                self._sock.send_multipart([peer, encode(Shutdown("publisher closed"))], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._sock.close()
        self._ctx.term()
        try:
            os.unlink(self._endpoint)
        except FileNotFoundError:
            pass

    def _close(self) -> None:
        self._comm.close()
        self._close_sockets()


# ---- subscriber -----------------------------------------------------------------------------


class NcclSubscriber(Subscriber):
    """Rank >= 1. ``device``: this rank's device (the actor's ``actor.device``): under NCCL its
    receive buffers and communicator live there, and it is required to be CUDA -- never a
    default, so two actors of one host cannot both land on ``cuda:0``. Under Gloo the buffers
    are on the CPU (Gloo broadcasts host memory) and ``device`` (default ``cpu``) is still the
    one claimed to the publisher. Waits up to ``timeout_s`` for the publisher's endpoint and
    rank; ``stop`` set: :class:`Stopped`."""

    transport = "nccl"

    def __init__(
        self, run_dir: str, timeout_s: float = 60, *, curve: net.Curve | None = None,
        device: torch.device | str | None = None, actor_id: str = "", collective_timeout_s: float = 300,
        stop=None,
    ):
        super().__init__()
        self._stopped = stop_check(stop)
        self.collective_timeout_s = collective_timeout_s
        self.publisher_closed = False
        path = endpoint_path(run_dir)
        deadline = time.monotonic() + timeout_s
        ep = wait_until(
            lambda: read_json(path), timeout_s, f"the nccl weight publisher's endpoint {path}; is the learner up?",
            stop=stop,
        )
        self._ctx = zmq.Context()
        self._sock = net.socket(self._ctx, zmq.DEALER, linger_ms=0)
        try:
            net.connect(self._sock, ep["host"], ep["port"], curve)
            self.device = torch.device(device if device is not None else "cpu")
            hello = Hello("weightsync", actor_id or f"{_socket.gethostname()}:{os.getpid()}")
            self._sock.send_multipart([encode(hello), encode(RankDevice(_socket.gethostname(), str(self.device)))])
            init = self._await_init(max(deadline - time.monotonic(), 1.0))
            self.rank, self.header = init.rank, init.layout
            self._hash = layout.layout_hash(self.header)
            self._payload = layout.payload_nbytes(self.header)
            self.buffer_device = rank_buffer_device(init.backend, device)
            self._bufs = [torch.empty(b.nbytes, dtype=torch.uint8, device=self.buffer_device)
                          for b in self.header.buckets]
            self._views = [list(layout.views(self.header, buf, i).items()) for i, buf in enumerate(self._bufs)]
            if init.backend == "nccl":
                self._comm = _NcclComm(init.world_size, init.unique_id, init.rank, self.buffer_device)
            else:
                self._comm = _GlooComm(init.world_size, init.unique_id, init.rank, collective_timeout_s)
        except BaseException:
            self._sock.close()
            self._ctx.term()
            raise
        self._pending: deque[WeightUpdateHeader] = deque()

    @classmethod
    def from_config(cls, cfg, run_dir: str, timeout_s: float = 60, *, stop=None, device=None) -> "NcclSubscriber":
        return cls(run_dir, timeout_s, curve=net.curve_from_config(cfg.net), device=device, stop=stop)

    def _await_init(self, timeout_s: float) -> CollectiveInit:
        deadline = time.monotonic() + timeout_s
        while not self._sock.poll(int(STOP_POLL_S * 1000)):
            if self._stopped():
                raise Stopped("nccl subscriber: stopped while waiting for the publisher to assign a rank")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"nccl subscriber: the publisher did not assign a rank in {timeout_s:.0f}s "
                    "(it waits until all world_size - 1 actors have joined)"
                )
        msg = _to_subscriber.decode(self._sock.recv())
        if isinstance(msg, Shutdown):
            raise RuntimeError(f"nccl subscriber: the publisher refused to start: {msg.reason}")
        if not isinstance(msg, CollectiveInit):
            raise RuntimeError(f"nccl subscriber: expected CollectiveInit, got {type(msg).__name__}")
        return msg

    def _drain(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = _to_subscriber.decode(frame)  # a malformed frame raises here, not in a copy
            if isinstance(msg, Shutdown):
                self.publisher_closed = True
            elif isinstance(msg, WeightUpdateHeader):
                if layout.layout_hash(msg) != self._hash:
                    raise layout.LayoutError(f"nccl subscriber: version {msg.version} changed the layout")
                self._pending.append(msg)

    def latest_version(self) -> int:
        self._drain()
        return self._pending[-1].version if self._pending else self.stats.last_version

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        self._drain()
        if not self._pending:
            return None
        layout.check_targets(self.header, named, role="nccl subscriber")
        self._comm.begin()
        while self._pending:
            version = self._pending.popleft().version
            for buf in self._bufs:
                self._comm.bcast(buf)
        self._comm.end(self.collective_timeout_s, f"version {version}", self._stopped)
        for views in self._views:
            for name, view in views:
                named[name].copy_(view)
        if self._bufs[0].is_cuda:
            torch.cuda.current_stream(self._bufs[0].device).synchronize()  # honest apply_s
        return version, self._payload

    def _close(self) -> None:
        self._comm.close()
        self._sock.close()
        self._ctx.term()


def _decode_join(frames: list[bytes]) -> RankDevice | None:
    """A subscriber's [identity, Hello, RankDevice] frames as its device claim; None if they
    are not that (a stranger, another schema)."""
    if len(frames) != 3:
        return None
    try:
        hello, claim = _hello.decode(frames[1]), _rank_device.decode(frames[2])
        torch.device(claim.device)
    except (msgspec.DecodeError, RuntimeError, ValueError):  # RuntimeError: not a device string
        return None
    return claim if hello.schema_version == SCHEMA_VERSION else None


def _decode_sglang_hello(frames: list[bytes]) -> Hello | None:
    """An SGLangLink's [identity, Hello] frames (it claims no device) as its Hello; None if not."""
    if len(frames) != 2:
        return None
    try:
        hello = _hello.decode(frames[1])
    except msgspec.DecodeError:
        return None
    return hello if hello.schema_version == SCHEMA_VERSION else None


def check_backend(backend: str, torch_backend: str, device: torch.device) -> None:
    """The publisher's ``backend`` (and, for sglang, its group's ``torch_backend``) against
    where the learner's weights are: NCCL broadcasts CUDA memory only."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "sglang" and torch_backend not in ("nccl", "gloo"):
        raise ValueError(f"torch_backend must be 'nccl' (CUDA) or 'gloo' (CPU tests), got {torch_backend!r}")
    if backend == "sglang" and torch_backend == "nccl" and device.type != "cuda":
        raise ValueError(f"SGLang servers receive weights over NCCL, which broadcasts CUDA memory, but the "
                         f"learner's weights are on {device}: set learner.device to a CUDA device")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the nccl transport needs CUDA tensors, but the learner's weights are on {device}: "
                         "set learner.device (and actor.device) to CUDA devices, or use weightsync.transport=shm")


def packed_views(header: WeightUpdateHeader, flat: torch.Tensor, bucket: int) -> list[tuple[str, torch.Tensor]]:
    """Bucket ``bucket``'s tensors as views into ``flat``, packed back to back in the bucket's
    order with no padding: SGLang's ``FlattenedTensorBucket`` layout, whose receive buffer for
    that bucket's ``/update_weights_from_distributed`` is exactly these bytes."""
    b, shapes = header.buckets[bucket], dict(zip(header.names, header.shapes))
    if flat.dtype != torch.uint8 or flat.numel() != packed_nbytes(header, bucket):
        raise layout.LayoutError(f"bucket {bucket}: packed buffer must be {packed_nbytes(header, bucket)} uint8 "
                                 f"bytes, got {flat.numel()} {flat.dtype}")
    out, lo = [], 0
    for name in b.names:
        size = layout.tensor_nbytes(b.dtype, shapes[name])
        out.append((name, flat[lo : lo + size].view(layout.torch_dtype(b.dtype)).view(shapes[name])))
        lo += size
    return out


def packed_nbytes(header: WeightUpdateHeader, bucket: int) -> int:
    b, shapes = header.buckets[bucket], dict(zip(header.names, header.shapes))
    return sum(layout.tensor_nbytes(b.dtype, shapes[name]) for name in b.names)


def _buffers(header: WeightUpdateHeader, device: torch.device, *, packed: bool):
    """One uint8 buffer per bucket and its (name, view) pairs: layout.views' aligned offsets,
    or SGLang's packed ones."""
    if packed:
        bufs = [torch.empty(packed_nbytes(header, i), dtype=torch.uint8, device=device)
                for i in range(len(header.buckets))]
        return bufs, [packed_views(header, buf, i) for i, buf in enumerate(bufs)]
    bufs = [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in header.buckets]
    return bufs, [list(layout.views(header, buf, i).items()) for i, buf in enumerate(bufs)]


def shared_devices(claims: list[tuple[str, str]]) -> list[list[int]]:
    """Groups of ranks (indices into ``claims`` of ``(host, device)``) that claim one CUDA
    device of one host; CPU ranks (Gloo) may share."""
    by_device: dict[tuple[str, str], list[int]] = {}
    for rank, (host, device) in enumerate(claims):
        if torch.device(device).type == "cuda":
            by_device.setdefault((host, str(torch.device(device))), []).append(rank)
    return [ranks for ranks in by_device.values() if len(ranks) > 1]


def rank_buffer_device(backend: str, device) -> torch.device:
    """Where a subscriber's receive buffers live: its own CUDA device under NCCL (required,
    never the current device), the CPU under Gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or dev.index is None:
        raise ValueError(f"the nccl transport needs each actor on its own CUDA device, but this subscriber's "
                         f"actor.device is {device!r}: set actor.device to 'cuda:N' (core/placement.py)")
    return dev
