"""Parameter server: the learner publishes weight versions, actors apply them between decode steps. Transports are
named as strings and imported only when chosen (:func:`weightsync.base.make_publisher`), so this package imports
nothing: no torch, no circle."""

PUBLISHERS = {"shm": "weightsync.files:ShmPublisher", "filesystem": "weightsync.files:FsPublisher",
              "nccl": "weightsync.nccl:NcclPublisher", "cuda_ipc": "weightsync.cuda_ipc:CudaIpcPublisher",
              "torch_dist": "weightsync.nccl:NcclPublisher"}
SUBSCRIBERS = {"shm": "weightsync.files:ShmSubscriber", "filesystem": "weightsync.files:FsSubscriber",
               "nccl": "weightsync.nccl:NcclSubscriber", "cuda_ipc": "weightsync.cuda_ipc:CudaIpcSubscriber",
               "torch_dist": "weightsync.nccl:GroupLink"}
# what an engine receives (Engine.receives; jobs.check_seams) -> its transports: "tensors" (a subscriber
# copies or maps into the engine's tensors) or "group" (its server receives the broadcasts itself: GroupLink)
DELIVERS = {"tensors": ("shm", "filesystem", "nccl", "cuda_ipc"), "group": ("torch_dist",)}
# the transports that can send a version as its changed elements (weightsync/delta.py; check_devices says why)
DELTA = ("shm", "filesystem", "nccl")


def delta_plan(cfg) -> tuple[bool, str | None]:
    """``(deltas on, the dtype published)`` for ``weightsync.delta``: ``auto`` is on for 16-bit actors over the
    transports that move bytes between hosts (filesystem, nccl); the actors' dtype if they share one (else None)."""
    mode, transport, dtype = cfg.weightsync.delta, cfg.weightsync.transport, cfg.actor.dtype
    dtype = None if dtype == "auto" else dtype  # actors on differing devices resolve their own
    auto = transport in ("filesystem", "nccl") and dtype in ("bfloat16", "float16")
    return (auto if mode == "auto" else mode == "on"), dtype


def check_devices(cfg, n_gpus: int | None = None) -> tuple[str, list[str]]:
    """:func:`core.placement.check`, then whether ``weightsync.transport`` can serve that placement (a ConfigError
    naming the device fields, else the devices). Run at launch and again in each role."""
    from core.config import ConfigError
    from core.placement import check

    learner, actors = check(cfg, n_gpus)
    transport, where = cfg.weightsync.transport, f"(learner.device -> {learner!r}, actor.device -> {actors})"
    cpu = ["learner.device"] * (learner == "cpu") + [f"actor {i}" for i, d in enumerate(actors) if d == "cpu"]
    if transport in ("nccl", "torch_dist") and cpu:
        raise ConfigError(f"weightsync.transport={transport!r} moves CUDA tensors, but {', '.join(cpu)} "
                          f"resolved to 'cpu' {where}: set learner.device/actor.device to CUDA devices"
                          + (", or use shm" if transport == "nccl" else ""))
    if cfg.weightsync.delta == "on" and transport not in DELTA:
        raise ConfigError(f"weightsync.delta='on' with weightsync.transport={transport!r}: deltas go over "
                          f"{', '.join(DELTA)} only (cuda_ipc moves no bytes; torch_dist's servers take whole tensors)")
    ranks = [learner, *actors]
    shared = sorted({d for d in ranks if ranks.count(d) > 1})
    if transport == "nccl" and shared:  # torch_dist servers pick their own GPU
        raise ConfigError(f"weightsync.transport='nccl' needs one CUDA device per rank, but {shared} hold several "
                          f"{where}: NCCL rejects two ranks on one GPU; use cuda_ipc on a shared device")
    if transport == "cuda_ipc" and any(d != learner or d == "cpu" for d in actors):
        raise ConfigError(f"weightsync.transport='cuda_ipc' shares device memory, so the learner and every "
                          f"actor must be on one CUDA device: {where}")
    return learner, actors
