"""Parameter server: the learner publishes weight versions, actors apply them between decode steps.

Transports: ``shm`` (one host; pinned slots, zero-copy for same-dtype CPU actors), ``filesystem`` (safetensors files, late
joiners), ``nccl`` (GPUs across hosts, via cupy). See :mod:`weightsync.base` for the interface.
Names are imported lazily so that :mod:`weightsync.layout` stays importable without torch.
"""

_BASE = ("Publisher", "PublishStats", "Subscriber", "SubscriberStats", "make_publisher", "make_subscriber")
__all__ = [*_BASE, "LayoutError"]


def __getattr__(name):
    if name in _BASE:
        from weightsync import base

        return getattr(base, name)
    if name == "LayoutError":
        from weightsync.layout import LayoutError

        return LayoutError
    raise AttributeError(name)
