"""Parameter server: the learner publishes weight versions, actors apply them between decode steps.

Transports (``weightsync.transport``), a seam like the others (core/registry.py): ``shm`` and
``filesystem`` are one implementation, weights as versioned files (:mod:`weightsync.files`; in a
private /dev/shm directory, or in ``run_dir/weights`` for hosts that share only a file system),
``nccl`` (GPUs across hosts, via cupy), ``cuda_ipc`` (one shared GPU). See :mod:`weightsync.base`
for the interface. Classes are named as strings and imported only when chosen
(:func:`weightsync.base.make_publisher`), so this package imports nothing: no torch, and no
circle through it.
"""

PUBLISHERS = {
    "shm": "weightsync.files:ShmPublisher",
    "filesystem": "weightsync.files:FsPublisher",
    "nccl": "weightsync.nccl:NcclPublisher",
    "cuda_ipc": "weightsync.cuda_ipc:CudaIpcPublisher",
}
SUBSCRIBERS = {
    "shm": "weightsync.files:ShmSubscriber",
    "filesystem": "weightsync.files:FsSubscriber",
    "nccl": "weightsync.nccl:NcclSubscriber",
    "cuda_ipc": "weightsync.cuda_ipc:CudaIpcSubscriber",
}
