"""Parameter server: the learner publishes weight versions, actors apply them between decode steps.

Transports (``weightsync.transport``) are named as strings and imported only when chosen
(:func:`weightsync.base.make_publisher`), so this package imports nothing: no torch, no circle.
An engine declares what it receives (``Engine.receives``); :data:`DELIVERS` says which transports
serve it, and the driver checks the pair before anything starts (jobs.check_seams).
"""

PUBLISHERS = {
    "shm": "weightsync.files:ShmPublisher",
    "filesystem": "weightsync.files:FsPublisher",
    "nccl": "weightsync.nccl:NcclPublisher",
    "cuda_ipc": "weightsync.cuda_ipc:CudaIpcPublisher",
    "torch_dist": "weightsync.nccl:NcclPublisher",
}
SUBSCRIBERS = {
    "shm": "weightsync.files:ShmSubscriber",
    "filesystem": "weightsync.files:FsSubscriber",
    "nccl": "weightsync.nccl:NcclSubscriber",
    "cuda_ipc": "weightsync.cuda_ipc:CudaIpcSubscriber",
    "torch_dist": "weightsync.nccl:GroupLink",
}
# what an engine receives -> the transports that deliver it: "tensors" (a subscriber copies or maps
# into the engine's own tensors) or "group" (a server joins a torch.distributed group and receives
# the broadcasts itself; its subscriber is a GroupLink that only follows the publisher)
DELIVERS = {"tensors": ("shm", "filesystem", "nccl", "cuda_ipc"), "group": ("torch_dist",)}
