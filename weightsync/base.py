"""Weight sync interface: the learner publishes numbered weight versions, actors apply them.

``Publisher`` (learner side) and ``Subscriber`` (actor side) hold the checks every transport
shares -- increasing versions, a layout fixed at start, updates under ``no_grad`` (in-place
copies, or for shm by default a zero-copy mapping), timing and counters -- and delegate the
moving of bytes to ``_write`` / ``_apply`` in the transports that ``weightsync.PUBLISHERS`` /
``weightsync.SUBSCRIBERS`` name (:mod:`weightsync.files` for ``shm`` and ``filesystem``,
:mod:`weightsync.nccl`, :mod:`weightsync.cuda_ipc`). :func:`make_publisher` /
:func:`make_subscriber` resolve ``cfg.weightsync.transport`` there by name, so this module
imports no transport and no transport's import comes back here in a circle.

An actor calls ``latest_version()`` between decode steps (cheap: a small file read, or a
non-blocking socket poll) and ``apply(params)`` when it is newer than what it holds, so a weight
update lands between two decode steps without stopping generation.

Every blocking wait (a subscriber waiting for its publisher, an NCCL publisher waiting for its
subscribers) has a deadline and takes ``stop``: a ``threading.Event`` (anything with
``is_set``) or a callable returning True to give up, e.g. the worker's SIGTERM event. A wait
that sees it set raises :class:`Stopped` within one poll interval.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from core.messages import WeightUpdateHeader
from core.registry import resolve
from weightsync import PUBLISHERS, SUBSCRIBERS, layout


@dataclass(frozen=True)
class PublishStats:
    version: int
    bytes: int
    seconds: float


@dataclass
class SubscriberStats:
    applies: int = 0
    last_version: int = -1  # newest version applied; -1 before the first apply
    apply_s: float = 0.0  # duration of the last apply
    apply_s_total: float = 0.0
    bytes: int = 0  # payload bytes of the last apply
    # versions published between two applies of this reader that it never applied (versions
    # before its first apply do not count: a late joiner is not behind)
    versions_skipped: int = 0
    mapped: int = 0  # tensors the last apply mapped from the version file instead of copying (shm)


class _Closable:
    """``close()`` once (idempotent; ``_close`` is the transport's part) and ``with`` support."""

    _closed = False

    def close(self) -> None:
        """Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Publisher(_Closable):
    """Learner side. Subclasses implement ``_write(version, named) -> payload bytes``, or None
    when the transport dropped that version (cuda_ipc with every device slot in use): ``publish``
    then returns None and ``skipped`` counts it."""

    transport = "?"

    def __init__(self, header: WeightUpdateHeader):
        self.header = layout.with_version(header, -1)
        self.last_stats: PublishStats | None = None
        self._last_version = -1
        self.skipped = 0
        self._closed = False

    def publish(self, version: int, named: Mapping[str, torch.Tensor]) -> PublishStats | None:
        if self._closed:
            raise RuntimeError(f"{self.transport} publisher is closed")
        if version < 0 or version <= self._last_version:
            raise ValueError(
                f"versions must increase: got {version} after {self._last_version} (ARCHITECTURE.md, Versions and staleness: "
                "a version is published once, after the optimiser step that made it)"
            )
        layout.check_targets(self.header, named, role=f"{self.transport} publisher", same_dtype=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            nbytes = self._write(version, named)
        self._last_version = version
        if nbytes is None:
            self.skipped += 1
            return None
        self.last_stats = PublishStats(version, nbytes, time.perf_counter() - t0)
        return self.last_stats

    @classmethod
    def from_config(cls, cfg, run_dir: str, template: Mapping[str, torch.Tensor], *, stop=None) -> "Publisher":
        """The learner's publisher of this transport, from the run's config (:func:`make_publisher`)."""
        raise NotImplementedError

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int | None:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        s = self.last_stats
        return {
            "weightsync/publish_s": s.seconds if s else 0.0,
            "weightsync/bytes": float(s.bytes) if s else 0.0,
            "weightsync/publishes_skipped": float(self.skipped),
        }



class Subscriber(_Closable):
    """Actor side. Subclasses implement ``latest_version()`` and
    ``_apply(named, after) -> (version, payload bytes) | None`` (copy, or map, the newest
    complete version newer than ``after`` into ``named``)."""

    transport = "?"

    def __init__(self):
        self.stats = SubscriberStats()
        self._closed = False

    @classmethod
    def from_config(cls, cfg, run_dir: str, timeout_s: float = 60, *, stop=None, device=None) -> "Subscriber":
        """An actor's subscriber of this transport, from the run's config (:func:`make_subscriber`)."""
        raise NotImplementedError

    def latest_version(self) -> int:
        raise NotImplementedError

    def apply(self, named: Mapping[str, torch.Tensor]) -> int | None:
        if self._closed:
            raise RuntimeError(f"{self.transport} subscriber is closed")
        t0 = time.perf_counter()
        with torch.no_grad():
            got = self._apply(named, self.stats.last_version)
        if got is None:
            return None
        version, nbytes = got
        s = self.stats
        if s.last_version >= 0:
            s.versions_skipped += version - s.last_version - 1
        s.last_version = version
        s.applies += 1
        s.apply_s = time.perf_counter() - t0
        s.apply_s_total += s.apply_s
        s.bytes = nbytes
        return version

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {
            "weightsync/apply_s": s.apply_s,
            "weightsync/apply_s_total": s.apply_s_total,
            "weightsync/bytes": float(s.bytes),
            "weightsync/versions_skipped": float(s.versions_skipped),
        }



class Stopped(RuntimeError):
    """A wait given up because the caller's ``stop`` flag was set (a SIGTERM during start-up)."""


def stop_check(stop) -> Callable[[], bool]:
    """``stop`` (None, an Event-like with ``is_set``, or a callable) as a callable."""
    if stop is None:
        return lambda: False
    return stop.is_set if hasattr(stop, "is_set") else stop


def pause(stop, seconds: float) -> None:
    """Sleep ``seconds``, waking at once when ``stop`` is an Event that gets set."""
    if hasattr(stop, "wait"):
        stop.wait(seconds)
    else:
        time.sleep(seconds)


def wait_until(ready, timeout_s: float, what: str, poll_s: float = 0.05, stop=None):
    """Poll ``ready()`` until it returns something truthy; TimeoutError naming ``what``, or
    Stopped once ``stop`` is set."""
    stopped = stop_check(stop)
    deadline = time.monotonic() + timeout_s
    while True:
        if stopped():
            raise Stopped(f"stopped while waiting for {what}")
        got = ready()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        pause(stop, poll_s)


def make_publisher(cfg, run_dir: str, template: Mapping[str, torch.Tensor], *, stop=None) -> Publisher:
    """The learner's publisher for ``cfg.weightsync.transport``; ``template`` fixes the layout.
    ``stop`` ends the nccl transport's wait for its subscribers (see :func:`wait_until`). With
    ``actor.engine=sglang`` the actors' servers join a torch.distributed group instead: the nccl
    transport's ``backend="sglang"`` mode (``NcclPublisher.from_config``)."""
    transport = cfg.weightsync.transport
    if cfg.actor.engine == "sglang" and transport != "nccl":
        raise ValueError(f"actor.engine=sglang receives weights over NCCL: set weightsync.transport=nccl "
                         f"(got weightsync.transport={transport!r})")
    return resolve(PUBLISHERS, transport, "weightsync transport").from_config(cfg, run_dir, template, stop=stop)


def make_subscriber(cfg, run_dir: str, timeout_s: float = 60, *, stop=None, device=None) -> Subscriber:
    """An actor's subscriber; waits up to ``timeout_s`` for the publisher to exist, or until
    ``stop`` is set (then raises :class:`Stopped`). ``device``: the actor's own (core/placement.py:
    actor_device), where the nccl and cuda_ipc transports put what they receive."""
    cls = resolve(SUBSCRIBERS, cfg.weightsync.transport, "weightsync transport")
    return cls.from_config(cfg, run_dir, timeout_s, stop=stop, device=device)
