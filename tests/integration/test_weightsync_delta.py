"""Delta publishing through the transports (weightsync/delta.py): a subscriber that applies every version,
one that missed versions, one that joined late and one whose publisher restarted all hold, bit for bit,
what a full publish gives; over the files transports and the nccl protocol (run over Gloo on CPU)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest
import torch

from core.config import load
from weightsync import files
from weightsync.base import make_publisher, make_subscriber
from weightsync.files import DamagedFile, FsPublisher, FsSubscriber, ShmPublisher, ShmSubscriber

PAIRS = [(ShmPublisher, ShmSubscriber), (FsPublisher, FsSubscriber)]


@pytest.fixture(autouse=True)
def _no_directory_left(tmp_path):
    yield
    files.remove_dead_region(str(tmp_path))


def _series(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """FP32 master weights after ``n`` small updates: a few percent of their BF16 casts change per version."""
    gen = torch.Generator().manual_seed(seed)
    w = {"embed": torch.randn(300, 32, generator=gen) * 0.02, "q": torch.randn(32, 32, generator=gen) * 0.02,
         "norm": torch.ones(32), "pos": torch.arange(7)}
    out = []
    for _ in range(n):
        w = {k: v + 1e-6 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 1
             for k, v in w.items()}
        out.append(w)
    return out


def _bf16(w):
    return {k: v.bfloat16() if v.is_floating_point() else v.clone() for k, v in w.items()}


def _exact(held, w) -> bool:
    want = _bf16(w)
    return all(held[k].dtype == want[k].dtype and torch.equal(held[k].view(-1).view(torch.uint8),
                                                               want[k].view(-1).view(torch.uint8)) for k in want)


def _zeros(w):
    return {k: torch.zeros_like(v) for k, v in _bf16(w).items()}


@pytest.mark.parametrize("pub_cls,sub_cls", PAIRS, ids=["shm", "filesystem"])
def test_every_subscriber_holds_a_full_publish_bit_for_bit(tmp_path, pub_cls, sub_cls):
    run_dir, ws = str(tmp_path), _series(30)
    pub = pub_cls(run_dir, _bf16(ws[0]))
    pub.use_delta(8, torch.bfloat16)
    full = sum(t.numel() * t.element_size() for t in _bf16(ws[0]).values())
    subs = {k: sub_cls(run_dir, 5, zero_copy=False, poll_s=0) for k in ("every", "missed")}
    held = {k: _zeros(ws[0]) for k in ("every", "missed", "late")}
    for v, w in enumerate(ws):
        pub.publish(v, w)  # FP32 master weights, published in BF16
        assert subs["every"].apply(held["every"]) == v and _exact(held["every"], w)
        if v % 5 == 4:  # misses four versions each time: walks the deltas, or a full version and its deltas
            assert subs["missed"].apply(held["missed"]) == v and _exact(held["missed"], w)
        if v == 13:
            subs["late"] = sub_cls(run_dir, 5, zero_copy=False, poll_s=0)
        if "late" in subs and v % 3 == 0:
            assert subs["late"].apply(held["late"]) == v and _exact(held["late"], w)
        names = os.listdir(pub.dir)
        newest_full = max(int(n[1:]) for n in names if n.startswith("v"))
        assert all(int(n[1:]) > newest_full for n in names if n.startswith("d"))  # a full version ends a chain
    assert pub.fulls == 4  # versions 0, 8, 16, 24
    assert pub.sent < 0.5 * 30 * full and 0 < pub.metrics()["weightsync/changed_frac"] < 0.5
    assert subs["every"].stats.bytes < full / 4  # the last apply read one delta
    for k, sub in subs.items():
        sub.apply(held[k])
        assert _exact(held[k], ws[-1]), k
        sub.close()
    pub.close()


def test_a_restarted_publisher_is_never_mistaken_for_the_old_one(tmp_path):
    """The new publisher reuses version numbers; its first delta names the old one's version as its base, but
    another epoch: the subscriber reads the new full version and its deltas."""
    run_dir, old, new = str(tmp_path), _series(6, seed=1), _series(7, seed=2)
    pub = FsPublisher(run_dir, _bf16(old[0]))
    pub.use_delta(50, torch.bfloat16)
    sub, held = FsSubscriber(run_dir, 5, poll_s=0), _zeros(old[0])
    for v, w in enumerate(old):
        pub.publish(v, w)
    assert sub.apply(held) == 5 and _exact(held, old[5])
    pub.close()
    pub = FsPublisher(run_dir, _bf16(new[0]))
    pub.use_delta(50, torch.bfloat16)
    for v in range(3, 7):
        pub.publish(v, new[v])
        assert sub.apply(held) == (None if v <= 5 else v)
    assert _exact(held, new[6])
    pub.close()
    sub.close()


def test_a_mapping_reader_and_a_damaged_delta_are_refused_by_name(tmp_path):
    run_dir, ws = str(tmp_path), _series(3)
    pub = ShmPublisher(run_dir, _bf16(ws[0]))
    pub.use_delta(50, torch.bfloat16)
    mapper, held = ShmSubscriber(run_dir, 5), _zeros(ws[0])
    pub.publish(0, ws[0])
    assert mapper.apply(held) == 0 and mapper.stats.mapped
    pub.publish(1, ws[1])
    with pytest.raises(ValueError, match="maps versions read-only"):
        mapper.apply(held)
    path = os.path.join(pub.dir, "d1")
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(DamagedFile, match="d1: payload checksum"):
        ShmSubscriber(run_dir, 5, zero_copy=False).apply(_zeros(ws[0]))
    mapper.close()
    pub.close()


def test_the_config_publishes_deltas_in_the_actors_dtype(tmp_path):
    cfg = load(None, ['weightsync.transport="filesystem"', "actor.dtype=bfloat16", "weightsync.full_every=4"])
    ws = _series(2)
    pub = make_publisher(cfg, str(tmp_path), ws[0])
    sub = make_subscriber(cfg, str(tmp_path), timeout_s=5)
    assert pub.delta is not None and pub.delta.full_every == 4 and not sub.zero_copy
    assert dict(zip(pub.header.names, pub.header.dtypes)) == {"embed": "bfloat16", "q": "bfloat16",
                                                              "norm": "bfloat16", "pos": "int64"}
    held = {k: torch.zeros_like(v) for k, v in ws[0].items()}  # an FP32 actor converts on apply, deltas too
    for v, w in enumerate(ws):
        pub.publish(v, w)
        assert sub.apply(held) == v
        assert all(torch.equal(held[k], _bf16(w)[k].to(held[k].dtype)) for k in w)
    pub.close()
    sub.close()


def _nccl_reader(run_dir: str, out_path: str, n: int) -> None:
    from weightsync.nccl import NcclSubscriber

    torch.set_num_threads(1)
    ws = _series(n)
    sub = NcclSubscriber(run_dir, timeout_s=30, collective_timeout_s=60)
    held, applied, exact, nbytes = _zeros(ws[0]), [], [], []
    while not applied or applied[-1] < n - 1:
        v = sub.apply(held)
        if v is not None:
            applied.append(v)
            exact.append(_exact(held, ws[v]))
            nbytes.append(sub.stats.bytes)
    with open(out_path, "w") as f:
        json.dump({"applied": applied, "exact": exact, "bytes": nbytes}, f)
    sub.close()


def test_nccl_protocol_sends_deltas_every_rank_applies_in_order(tmp_path):
    from weightsync.nccl import NcclPublisher

    run_dir, out, n = str(tmp_path / "run"), str(tmp_path / "reader.json"), 12
    proc = mp.get_context("spawn").Process(target=_nccl_reader, args=(run_dir, out, n), daemon=True)
    proc.start()
    try:
        ws = _series(n)
        pub = NcclPublisher(run_dir, _bf16(ws[0]), bucket_bytes=8 << 10, world_size=2, backend="gloo",
                            join_timeout_s=60, collective_timeout_s=60)
        pub.use_delta(5, torch.bfloat16)
        sizes = [pub.publish(v, w).bytes for v, w in enumerate(ws)]
        proc.join(60)
        assert proc.exitcode == 0
        r = json.load(open(out))
        full = max(sizes)
        assert [s == full for s in sizes] == [v % 5 == 0 for v in range(n)]  # full at 0, 5, 10; deltas between
        assert all(r["exact"]) and r["applied"][-1] == n - 1
        assert min(r["bytes"]) < full / 4  # an apply that received only deltas
        pub.close()
    finally:
        if proc.is_alive():
            proc.kill()


def _header_end(w) -> int:
    """Where a full version's header ends without an epoch, at its widest numbers."""
    head = files.FileHeader(files.layout.header_for(-1, w, 64 << 20), 2**62, 2**62)
    return files._PREFIX.size + len(files._encoder.encode(head))


def test_a_header_that_ends_at_a_page_edge_leaves_room_for_the_epoch(tmp_path):
    """A full version's header names the publisher's epoch once deltas are on: the payload starts after the
    widest header, epoch included, even where the header without it ends just below a page boundary."""
    def weights(n):  # the name's length moves the header's end
        return {"x" * n: torch.arange(4, dtype=torch.float32).bfloat16()}
    edge = [n for n in range(3000, 3000 + files.PAGE) if _header_end(weights(n)) % files.PAGE > files.PAGE - 24]
    assert edge
    for n in edge:
        w, run_dir = weights(n), str(tmp_path / str(n))
        pub, sub = FsPublisher(run_dir, w), FsSubscriber(run_dir, 5, poll_s=0)
        pub.use_delta(8, torch.bfloat16)
        pub.publish(0, w)
        held = {k: torch.zeros_like(v) for k, v in w.items()}
        assert sub.apply(held) == 0 and all(torch.equal(held[k], w[k]) for k in w), n
        pub.close()
        sub.close()
