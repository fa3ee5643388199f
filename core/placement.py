"""Device placement: which device each role computes on, from ``learner.device`` and ``actor.device``.

Values are ``"auto"``, ``"cpu"``, ``"cuda"`` (= ``"cuda:0"``, torch's meaning) or ``"cuda:N"``;
``actor.device`` may also be a list with one entry per actor. :func:`place` is pure (the GPU
count is an argument) and resolves ``auto`` so that a host needs no configuration:

- no GPU: every role on ``cpu`` (today's CPU run, unchanged);
- one GPU: every role on ``cuda:0`` -- the roles share it (weights can then move device-side,
  ``weightsync.transport=cuda_ipc``);
- N >= 2 GPUs: the learner on ``cuda:0``, actor i on ``cuda:1 + i % (N - 1)``: the learner's
  optimiser state never competes with an engine's KV cache for memory.

:func:`check` is the validation every entry point runs before it allocates anything (``run.py``
before it starts the roles, each role again at its own start, so a role started by hand fails
the same way): a malformed value, a CUDA device on a machine without CUDA, an index past the
device count, a list of the wrong length, an unknown weight transport, or one the placement
cannot serve (NCCL needs every rank on its own CUDA device; CUDA IPC needs every role on one
device) is a :class:`core.config.ConfigError` naming the field and its value.
"""

from __future__ import annotations

import re

from core.config import ConfigError

_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA); torch is imported only here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _no_cuda_reason() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} built without CUDA"
    return f"torch {torch.__version__} built for CUDA {torch.version.cuda}, but no device is visible"


def _auto_learner(n_gpus: int) -> str:
    return "cuda:0" if n_gpus else "cpu"


def _auto_actor(index: int, n_gpus: int) -> str:
    if n_gpus == 0:
        return "cpu"
    return "cuda:0" if n_gpus == 1 else f"cuda:{1 + index % (n_gpus - 1)}"


def resolve(field: str, value, n_gpus: int, auto: str) -> str:
    """One device value as ``cpu`` or ``cuda:N``; ConfigError naming ``field`` if it cannot be."""
    m = _DEVICE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"`$.{field}` = {value!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if value == "auto":
        return auto
    if value == "cpu":
        return "cpu"
    if n_gpus == 0:
        raise ConfigError(f"{field}={value!r} but this machine has no CUDA ({_no_cuda_reason()})")
    index = int(m.group(1) or 0)
    if index >= n_gpus:
        raise ConfigError(f"{field}={value!r} but this machine has {n_gpus} CUDA device(s) (cuda:0..cuda:{n_gpus - 1})")
    return f"cuda:{index}"


def actor_entry(actor_cfg, index: int):
    """Actor ``index``'s raw ``actor.device`` value (its list entry when it is a list)."""
    value = actor_cfg.device
    if not isinstance(value, (list, tuple)):
        return value
    if len(value) != actor_cfg.num_actors:
        raise ConfigError(f"`$.actor.device` lists {len(value)} devices for actor.num_actors = "
                          f"{actor_cfg.num_actors}: give one per actor, or one string for all")
    return value[index]


def resolve_actor(actor_cfg, index: int, n_gpus: int) -> str:
    """Actor ``index``'s device as ``cpu`` or ``cuda:N``."""
    field = "actor.device" if isinstance(actor_cfg.device, str) else f"actor.device[{index}]"
    return resolve(field, actor_entry(actor_cfg, index), n_gpus, _auto_actor(index, n_gpus))


def place(cfg, n_gpus: int) -> tuple[str, list[str]]:
    """``(learner device, [device of actor i])`` on a host with ``n_gpus`` CUDA devices."""
    learner = resolve("learner.device", cfg.learner.device, n_gpus, _auto_learner(n_gpus))
    return learner, [resolve_actor(cfg.actor, i, n_gpus) for i in range(cfg.actor.num_actors)]


def check_transport(transport: str, learner: str, actors: list[str]) -> None:
    """A weight transport the placement can serve; ConfigError naming the device fields."""
    if transport == "nccl":
        cpu = ["learner.device"] * (learner == "cpu") + [f"actor {i}" for i, d in enumerate(actors) if d == "cpu"]
        if cpu:
            raise ConfigError(f"weightsync.transport='nccl' moves CUDA tensors, but {', '.join(cpu)} "
                              f"resolved to 'cpu' (learner.device -> {learner!r}, actor.device -> {actors}): "
                              "set learner.device/actor.device to CUDA devices, or use shm")
        ranks = [learner, *actors]
        shared = sorted({d for d in ranks if ranks.count(d) > 1})
        if shared:
            raise ConfigError(f"weightsync.transport='nccl' needs one CUDA device per rank, but {shared} "
                              f"hold several (learner.device -> {learner!r}, actor.device -> {actors}): "
                              "NCCL rejects two ranks on one GPU; use cuda_ipc on a shared device")
    if transport == "cuda_ipc" and any(d != learner or d == "cpu" for d in actors):
        raise ConfigError(f"weightsync.transport='cuda_ipc' shares device memory, so the learner and every "
                          f"actor must be on one CUDA device: learner.device -> {learner!r}, "
                          f"actor.device -> {actors}")


def check(cfg, n_gpus: int | None = None) -> tuple[str, list[str]]:
    """:func:`place` on this machine (or ``n_gpus``), then :func:`check_transport`."""
    learner, actors = place(cfg, visible_gpus() if n_gpus is None else n_gpus)
    check_transport(cfg.weightsync.transport, learner, actors)
    return learner, actors


def learner_device(cfg):
    """The learner's ``torch.device`` (validated as :func:`check` does)."""
    import torch

    return torch.device(check(cfg)[0])


def actor_device(cfg, index: int):
    """Actor ``index``'s ``torch.device`` (validated as :func:`check` does)."""
    import torch

    if not 0 <= index < cfg.actor.num_actors:
        raise ConfigError(f"actor index {index} is outside actor.num_actors = {cfg.actor.num_actors}")
    return torch.device(check(cfg)[1][index])
