"""Device placement: which device each role computes on, from ``learner.device`` and ``actor.device``. ``auto``
needs no configuration: no GPU, all on ``cpu``; one GPU, all share ``cuda:0``; N >= 2, the learner on ``cuda:0`` and
actor i on ``cuda:1 + i % (N - 1)`` (the learner's optimiser state never competes with an engine's KV cache).
:func:`check` runs before anything allocates (at launch, and in each role again, so a role started by hand fails
alike): any value the machine cannot serve is a ConfigError naming the field."""

from __future__ import annotations

import re

from core.config import ConfigError

_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(field: str, value, n_gpus: int, auto: str) -> str:
    """One device value as ``cpu`` or ``cuda:N``; ConfigError naming ``field`` if it cannot be."""
    m = _DEVICE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"`$.{field}` = {value!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if value in ("auto", "cpu"):
        return auto if value == "auto" else "cpu"
    if n_gpus == 0:
        import torch

        cuda = torch.version.cuda
        why = f"built for CUDA {cuda}, but no device is visible" if cuda else "built without CUDA"
        raise ConfigError(f"{field}={value!r} but this machine has no CUDA (torch {torch.__version__} {why})")
    index = int(m.group(1) or 0)
    if index >= n_gpus:
        raise ConfigError(f"{field}={value!r} but this machine has {n_gpus} CUDA device(s) (cuda:0..cuda:{n_gpus - 1})")
    return f"cuda:{index}"


def resolve_actor(actor_cfg, index: int, n_gpus: int) -> str:
    value = actor_cfg.device
    if isinstance(value, (list, tuple)):
        if len(value) != actor_cfg.num_actors:
            raise ConfigError(f"`$.actor.device` lists {len(value)} devices for actor.num_actors = "
                              f"{actor_cfg.num_actors}: give one per actor, or one string for all")
        value = value[index]
    field = "actor.device" if isinstance(actor_cfg.device, str) else f"actor.device[{index}]"
    auto = "cpu" if n_gpus == 0 else "cuda:0" if n_gpus == 1 else f"cuda:{1 + index % (n_gpus - 1)}"
    return resolve(field, value, n_gpus, auto)


def check(cfg, n_gpus: int | None = None) -> tuple[str, list[str]]:
    """``(learner device, [device of actor i])`` on this machine (or a host with ``n_gpus`` CUDA devices);
    the transport's own rules: :func:`weightsync.check_devices`."""
    n_gpus = visible_gpus() if n_gpus is None else n_gpus
    learner = resolve("learner.device", cfg.learner.device, n_gpus, "cuda:0" if n_gpus else "cpu")
    return learner, [resolve_actor(cfg.actor, i, n_gpus) for i in range(cfg.actor.num_actors)]


def learner_device(cfg):
    import torch

    return torch.device(check(cfg)[0])


def actor_device(cfg, index: int):
    import torch

    if not 0 <= index < cfg.actor.num_actors:
        raise ConfigError(f"actor index {index} is outside actor.num_actors = {cfg.actor.num_actors}")
    return torch.device(check(cfg)[1][index])
