"""The learner's publisher in ``backend="torch_dist"`` mode (weightsync/nccl.py), over Gloo on CPU.

Its peers are the SGLang engine's real link (``weightsync.nccl.GroupLink``) in child
processes, each with a receiving rank that joins the group the way SGLang 0.5.23's
``init_custom_process_group`` does (rendezvous, ``PrefixStore(group_name)``,
``_new_process_group_helper``) and receives every ``/update_weights_from_distributed`` body of
``bucket_bodies`` as one packed uint8 broadcast, unpacked as ``FlattenedTensorBucket`` does. The
same publisher against SGLang's own receiver code: tests/sglang/test_publisher_contract.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from core.config import load
from tests.support.runs import ROOT
from tests.support.weights import random_weights
from weightsync import layout
from weightsync.base import make_publisher
from weightsync.nccl import NcclPublisher, check_backend

SPECS = [("embed", torch.bfloat16, [40, 16]), ("l0.q", torch.float32, [16, 16]), ("l0.norm", torch.float32, [16]),
         ("l1.q", torch.bfloat16, [16, 16]), ("head", torch.float16, [16, 12]), ("scale", torch.float32, [])]

RECEIVER = r"""
import datetime, json, sys, time
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
from actor.engines.sglang import bucket_bodies, join_body
from weightsync.nccl import GroupLink

args = json.loads(sys.argv[1])
link = GroupLink(args["run_dir"], timeout_s=60, actor_id=args["id"])
timeout = datetime.timedelta(seconds=60)


def group(body):
    # SGLang's init_custom_process_group with this /init_weights_update_group body, on Gloo
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world = next(rendezvous(url, body["rank_offset"], body["world_size"], timeout=timeout))
    name = body["group_name"]
    pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore(name, store),
                                      group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def receive(pg, version, got):
    deadline = time.monotonic() + 60
    while link.latest_version() < version and time.monotonic() < deadline:
        time.sleep(0.005)
    header = link.pending.pop(0)
    assert header.version == version, (header.version, version)
    for b in bucket_bodies(header):  # FlattenedTensorBucket: one packed uint8 tensor per body
        dtypes = [getattr(torch, d) for d in b["dtypes"]]
        sizes = [torch.Size(s).numel() * dt.itemsize for s, dt in zip(b["shapes"], dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=pg)
        lo = 0
        for name, dt, shape, size in zip(b["names"], dtypes, b["shapes"], sizes):
            got[f"{version}/{name}"] = flat[lo:lo + size].view(dt).reshape(shape).clone()
            lo += size


got, joins = {}, []
for i, versions in enumerate(args["phases"]):
    if i:
        open(args["out"] + f".rejoin{i}", "w").close()  # the test waits for this Hello before publishing
    if i == args.get("new_link_at"):  # a restarted actor: a new socket, the same actor id
        link.close()
        link = GroupLink(args["run_dir"], timeout_s=60, actor_id=args["id"])
    body = join_body(link.join())
    joins.append(body)
    pg = group(body)
    for v in versions:
        receive(pg, v, got)
    dist.destroy_process_group(pg)
save_file(got, args["out"])
with open(args["out"] + ".json", "w") as f:
    json.dump(joins, f)
# everything is written: skip the interpreter's teardown, where a c10d store's native thread
# sometimes aborts the process ("terminate called without an active exception", seen under load)
import os
os._exit(0)
"""


def _weights(version: int) -> dict[str, torch.Tensor]:
    """Arbitrary bit patterns (NaNs included: bit-exactness, not value equality), new per version."""
    return random_weights(SPECS, 1000 + version)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _receiver(run_dir: str, out: str, actor_id: str, phases: list[list[int]], new_link_at=None) -> subprocess.Popen:
    args = {"run_dir": run_dir, "out": out, "id": actor_id, "phases": phases, "new_link_at": new_link_at}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", RECEIVER, json.dumps(args)], cwd=ROOT, env=env)


def _publisher(run_dir: str, world: int) -> NcclPublisher:
    return NcclPublisher(run_dir, _weights(0), bucket_bytes=1024, world_size=world, backend="torch_dist",
                         torch_backend="gloo", join_timeout_s=60, collective_timeout_s=60)


def _check(out: str, versions: list[int]) -> list[dict]:
    from safetensors.torch import load_file

    got = load_file(out)
    assert set(got) == {f"{v}/{name}" for v in versions for name, _, _ in SPECS}
    for v in versions:
        for name, t in _weights(v).items():
            assert _same_bits(got[f"{v}/{name}"], t), (v, name)
    with open(out + ".json") as f:
        return json.load(f)


def _wait(children: list[subprocess.Popen]) -> None:
    for c in children:
        assert c.wait(60) == 0


# ---- pure parts


def test_packed_views_are_flattened_bucket_bytes():
    """Each bucket's tensors back to back with no padding, in the bucket's order (what SGLang's
    FlattenedTensorBucket receive buffer holds), unlike the default aligned views."""
    named = _weights(1)
    header = layout.header_for(-1, named, 1024)
    assert len(header.buckets) > 3
    for i, b in enumerate(header.buckets):
        flat = torch.empty(layout.packed_nbytes(header, i), dtype=torch.uint8)
        views = layout.views(header, flat, i, packed=True)
        assert list(views) == list(b.names)
        for name, view in views.items():
            view.copy_(named[name])
        want = torch.cat([named[n].reshape(-1).view(torch.uint8) for n in b.names])
        assert torch.equal(flat, want)
    with pytest.raises(layout.LayoutError, match="layout needs"):
        layout.views(header, torch.empty(layout.packed_nbytes(header, 0) - 1, dtype=torch.uint8), 0, packed=True)


def test_bad_backends_are_refused_by_name():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        check_backend("sglng", "gloo", cpu)
    with pytest.raises(ValueError, match="torch_backend"):
        check_backend("torch_dist", "mpi", cpu)
    with pytest.raises(ValueError, match="servers receive over NCCL"):
        check_backend("torch_dist", "nccl", cpu)
    check_backend("torch_dist", "gloo", cpu)


def test_make_publisher_chooses_the_group_mode_by_transport(tmp_path):
    # the torch_dist mode (an NCCL group), refused here only because these weights are on the CPU
    cfg = load(None, ['actor.engine="sglang"', 'weightsync.transport="torch_dist"'])
    with pytest.raises(ValueError, match="servers receive over NCCL"):
        make_publisher(cfg, str(tmp_path), _weights(0))


# ---- the protocol, with real links and receiving ranks in child processes


@pytest.mark.slow
def test_two_sglang_links_receive_two_versions_bit_exact(tmp_path):
    run_dir = str(tmp_path / "run")
    outs = [str(tmp_path / f"r{i}.safetensors") for i in range(2)]
    children = [_receiver(run_dir, out, f"actor-{i}", [[1, 2]]) for i, out in enumerate(outs)]
    pub = None
    try:
        pub = _publisher(run_dir, 3)
        for v in (1, 2):
            stats = pub.publish(v, _weights(v))
            assert stats.bytes == layout.payload_nbytes(pub.header)
        _wait(children)
    finally:  # closed on a failure too: an open socket's context would block the GC forever
        if pub is not None:
            pub.close()
        for c in children:
            c.kill()
    bodies = [_check(out, [1, 2])[0] for out in outs]
    assert sorted(b["rank_offset"] for b in bodies) == [1, 2]
    assert all(b["world_size"] == 3 and b["group_name"] == "driftrl_weights" for b in bodies)


@pytest.mark.slow
def test_a_repeat_hello_gets_a_rebuilt_group(tmp_path):
    """A restarted server's link says Hello again (version 2: the engine's own link; version 3: a
    restarted actor's new link, known by its actor id): each time the next publish builds a new
    group (a new store), and the version after the restart arrives bit-exact through it."""
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "r.safetensors")
    child = _receiver(run_dir, out, "actor-0", [[1], [2], [3]], new_link_at=2)
    pub = None
    try:
        pub = _publisher(run_dir, 2)
        pub.publish(1, _weights(1))
        for v in (2, 3):
            deadline = time.monotonic() + 60
            while not os.path.exists(out + f".rejoin{v - 1}") and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pub._sock.poll(30_000)  # the repeat Hello is queued (not consumed) before version v
            pub.publish(v, _weights(v))
        _wait([child])
        assert pub.rebuilds == 2 and pub.bad_frames == 0
    finally:  # as above: never leave an open socket to the GC
        if pub is not None:
            pub.close()
        child.kill()
    joins = _check(out, [1, 2, 3])
    assert [j["rank_offset"] for j in joins] == [1, 1, 1]
    assert len({j["master_port"] for j in joins}) == 3
