"""Device placement: auto resolution by GPU count, and clear errors naming the field."""

from __future__ import annotations

import pytest
import torch

import jobs

from core import placement
from core.config import ConfigError, load
from weightsync import check_devices


def _cfg(*overrides):
    return load(None, list(overrides))


@pytest.mark.parametrize("n_gpus, learner, actors", [
    (0, "cpu", ["cpu", "cpu", "cpu"]),
    (1, "cuda:0", ["cuda:0", "cuda:0", "cuda:0"]),  # one GPU: the roles share it
    (2, "cuda:0", ["cuda:1", "cuda:1", "cuda:1"]),
    (3, "cuda:0", ["cuda:1", "cuda:2", "cuda:1"]),  # round-robin over the learner's others
])
def test_auto_placement(n_gpus, learner, actors):
    cfg = _cfg("actor.num_actors=3", "learner.groups_per_step=3")
    assert placement.check(cfg, n_gpus) == (learner, actors)


def test_explicit_values_and_per_actor_lists():
    cfg = _cfg("actor.num_actors=2", "learner.groups_per_step=2", 'learner.device="cuda"',
               'actor.device=["cuda:3", "cpu"]')
    assert placement.check(cfg, 4) == ("cuda:0", ["cuda:3", "cpu"])
    assert placement.check(_cfg('learner.device="cpu"', 'actor.device="cpu"'), 8) == ("cpu", ["cpu"])


@pytest.mark.parametrize("overrides, match", [
    (['learner.device="gpu0"'], r"`\$.learner.device` = 'gpu0' is not a device"),
    (['actor.device="cuda:x"'], r"`\$.actor.device` = 'cuda:x' is not a device"),
    (['learner.device="cuda:2"'], r"learner.device='cuda:2' but this machine has 2 CUDA device\(s\)"),
    (['actor.device=["cuda:0", "cuda:1"]'], r"lists 2 devices for actor.num_actors = 1"),
    (['actor.num_actors=2', 'learner.groups_per_step=2', 'actor.device=["cuda:1", "cuda:5"]'],
     r"actor.device\[1\]='cuda:5'"),
])
def test_bad_values_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        placement.check(_cfg(*overrides), 2)


def test_cuda_without_cuda_says_why():
    with pytest.raises(ConfigError, match=r"learner.device='cuda:0' but this machine has no CUDA \(torch "):
        placement.check(_cfg('learner.device="cuda:0"'), 0)
    if not torch.cuda.is_available():  # this machine's own answer, as every role start checks it
        with pytest.raises(ConfigError, match=r"actor.device='cuda' but this machine has no CUDA"):
            placement.actor_device(_cfg('actor.device="cuda"'), 0)
        assert placement.learner_device(_cfg()) == torch.device("cpu")


def test_transports_the_placement_cannot_serve():
    nccl = ['weightsync.transport="nccl"', "actor.num_actors=2", "learner.groups_per_step=2"]
    with pytest.raises(ConfigError, match=r"learner.device, actor 0, actor 1 resolved to 'cpu'"):
        check_devices(_cfg(*nccl), n_gpus=0)
    with pytest.raises(ConfigError, match=r"one CUDA device per rank, but \['cuda:1'\]"):
        check_devices(_cfg(*nccl), n_gpus=2)  # auto puts both actors on cuda:1
    assert check_devices(_cfg(*nccl), n_gpus=3) == ("cuda:0", ["cuda:1", "cuda:2"])
    with pytest.raises(ConfigError, match="one CUDA device"):
        check_devices(_cfg('weightsync.transport="cuda_ipc"'), n_gpus=2)  # actor on cuda:1
    assert check_devices(_cfg(), n_gpus=0) == ("cpu", ["cpu"])  # shm serves any placement
    torch_dist = 'weightsync.transport="torch_dist"'  # a server engine's NCCL group: CUDA, any sharing
    with pytest.raises(ConfigError, match=r"'torch_dist' moves CUDA tensors, but learner.device, actor 0"):
        check_devices(_cfg(torch_dist), n_gpus=0)
    assert check_devices(_cfg(torch_dist), n_gpus=1) == ("cuda:0", ["cuda:0"])


def test_an_unknown_transport_is_refused_before_anything_starts():
    import weightsync

    cfg = _cfg('weightsync.transport="carrier-pigeon"')  # a str: loading accepts it, the seam check does not
    with pytest.raises(ConfigError, match=r"`\$.weightsync.transport` = 'carrier-pigeon' is not one of "
                                          r"cuda_ipc, filesystem, nccl, shm, torch_dist"):
        jobs.check_seams(cfg)  # before any role starts
    assert set(weightsync.PUBLISHERS) == set(weightsync.SUBSCRIBERS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the roles would start")
def test_a_role_started_by_hand_fails_as_run_py_would(tmp_path):
    from actor.worker import RolloutWorker
    from learner.loop import LearnerLoop
    from tests.support.tiny import tiny_cfg

    with pytest.raises(ConfigError, match=r"actor.device='cuda:0' but this machine has no CUDA"):
        RolloutWorker(tiny_cfg('actor.device="cuda:0"'), str(tmp_path), 0)
    with pytest.raises(ConfigError, match=r"learner.device='cuda' but this machine has no CUDA"):
        LearnerLoop(tiny_cfg('learner.device="cuda"'), str(tmp_path))


def test_the_engine_builds_on_its_actor_device():
    from actor.engines import make_engine
    from tests.support.tiny import tiny_cfg

    cfg = tiny_cfg("actor.num_actors=2", "learner.groups_per_step=2", 'actor.device=["cpu", "cuda:7"]')
    engine = make_engine(cfg.actor, cfg.model.path)  # a list: actor 0's entry (the contract check)
    assert engine.device == torch.device("cpu") and engine.gen.device == torch.device("cpu")
    assert next(engine.model.parameters()).device == torch.device("cpu")
    engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert engine._cache.k[0].device == torch.device("cpu")
