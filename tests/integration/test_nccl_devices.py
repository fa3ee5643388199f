"""The NCCL transport's device assignment, run over Gloo on CPU: one device per rank.

Each subscriber is given the device core/placement.py assigns to its actor on a 3-GPU host; it
claims that device to the publisher in its join (RankDevice) and the publisher records rank ->
device and refuses two ranks on one CUDA device. Under Gloo the receive buffers are host memory,
so the "cuda:i" strings are the devices the ranks would use under NCCL: a subscriber ignoring its
assignment (falling back to the current device, as before) claims another device and fails here.
Ranks run as threads (Gloo process groups of one process), so this costs no process start.
"""

from __future__ import annotations

import threading

import pytest
import torch

from core import placement
from core.config import load
from weightsync import check_devices
from core.messages import Hello, encode
from weightsync.nccl import NcclPublisher, NcclSubscriber, RankDevice, _decode_join, rank_buffer_device, shared_devices


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed": torch.randn(300, 64, generator=g).bfloat16(), "q": torch.randn(64, 64, generator=g),
            "step": torch.tensor([version], dtype=torch.int64)}


def _subscribers(run_dir: str, devices: list[str], out: dict) -> list[threading.Thread]:
    def join(i: int, device: str) -> None:
        try:
            out[i] = NcclSubscriber(run_dir, timeout_s=30, device=torch.device(device), actor_id=f"actor{i}",
                                    collective_timeout_s=30)
        except Exception as e:  # noqa: BLE001 -- reported to the test thread
            out[i] = e

    threads = [threading.Thread(target=join, args=(i, d), daemon=True) for i, d in enumerate(devices)]
    for t in threads:
        t.start()
    return threads


def test_each_rank_claims_its_own_assigned_device(tmp_path):
    cfg = load(None, ['weightsync.transport="nccl"', "actor.num_actors=2", "learner.groups_per_step=2"])
    learner, actors = check_devices(cfg, n_gpus=3)
    assert actors == ["cuda:1", "cuda:2"] and learner not in actors
    subs: dict = {}
    threads = _subscribers(str(tmp_path), actors, subs)
    pub = NcclPublisher(str(tmp_path), _state(0), 16 << 10, world_size=3, backend="gloo", join_timeout_s=30,
                        collective_timeout_s=30)
    for t in threads:
        t.join(30)
    try:
        assert all(isinstance(s, NcclSubscriber) for s in subs.values()), subs
        by_rank = {s.rank: str(s.device) for s in subs.values()}
        assert sorted(by_rank.values()) == actors  # each on its assignment, no two alike
        assert {r: d for r, d in pub.rank_devices.items() if r} == by_rank
        assert all(s.buffer_device == torch.device("cpu") for s in subs.values())  # Gloo: host buffers
        done = threading.Thread(target=pub.publish, args=(3, _state(3)))
        done.start()
        targets = {i: {k: torch.zeros_like(v) for k, v in _state(0).items()} for i in subs}
        appliers = [threading.Thread(target=_apply_when_ready, args=(subs[i], targets[i])) for i in subs]
        for t in appliers:
            t.start()
        for t in (done, *appliers):
            t.join(30)
        assert all(torch.equal(targets[i][k], v) for i in subs for k, v in _state(3).items())
    finally:
        for s in subs.values():
            if isinstance(s, NcclSubscriber):
                s.close()
        pub.close()


def _apply_when_ready(sub: NcclSubscriber, target) -> None:
    for _ in range(3000):
        if sub.latest_version() >= 0:
            sub.apply(target)
            return
        threading.Event().wait(0.01)


def test_two_ranks_on_one_device_are_refused_with_their_names(tmp_path):
    subs: dict = {}
    threads = _subscribers(str(tmp_path), ["cuda:1", "cuda:1"], subs)
    with pytest.raises(ValueError, match=r"ranks \[\[1, 2\]\] share a CUDA device"):
        NcclPublisher(str(tmp_path), _state(0), world_size=3, backend="gloo", join_timeout_s=30)
    for t in threads:
        t.join(30)
    assert all(isinstance(e, RuntimeError) and "share a CUDA device" in str(e) for e in subs.values()), subs


def test_device_rules():
    assert shared_devices([("a", "cuda:0"), ("a", "cuda:1"), ("b", "cuda:1"), ("a", "cpu"), ("a", "cpu")]) == []
    assert shared_devices([("a", "cuda:0"), ("a", "cuda:1"), ("a", "cuda:1")]) == [[1, 2]]
    join = [b"peer", encode(Hello("weightsync", "a0"))]
    assert _decode_join([*join, encode(RankDevice("h", "cuda:2"))])[1] == RankDevice("h", "cuda:2")
    assert _decode_join([*join, encode(RankDevice("h", "warp:9"))]) is None  # counted as a bad frame
    assert _decode_join(join) is None
    assert rank_buffer_device("nccl", "cuda:3") == torch.device("cuda:3")
    assert rank_buffer_device("gloo", "cuda:3") == torch.device("cpu")
    for bad in (None, "cpu", "cuda"):  # never a default or the current device
        with pytest.raises(ValueError, match="actor.device"):
            rank_buffer_device("nccl", bad)


def test_nccl_with_host_tensors_names_the_device_settings(tmp_path):
    with pytest.raises(ValueError, match=r"learner.device \(and actor.device\)"):
        NcclPublisher(str(tmp_path), _state(0), world_size=2, backend="nccl")
    cfg = load(None, ['weightsync.transport="nccl"'])
    with pytest.raises(Exception, match="learner.device, actor 0 resolved to 'cpu'"):
        check_devices(cfg, n_gpus=0)
