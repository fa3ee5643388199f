"""What every weight transport shares: increasing versions, a layout fixed at start, ``no_grad``, timing and counters;
transports move the bytes in ``_write`` / ``_apply``. Every blocking wait has a deadline and takes ``stop`` (an
Event-like or a callable): once it is set the wait raises :class:`Stopped` within one poll interval."""

from __future__ import annotations

import abc
import contextlib
import time
from dataclasses import dataclass
from typing import Mapping

import torch

from core.messages import WeightUpdateHeader
from core.registry import resolve
from weightsync import PUBLISHERS, SUBSCRIBERS, delta, delta_plan, layout


@dataclass(frozen=True)
class PublishStats:
    version: int
    bytes: int
    seconds: float


@dataclass
class SubscriberStats:
    last_version: int = -1  # newest version applied; -1 before the first apply
    apply_s: float = 0.0  # duration of the last apply
    apply_s_total: float = 0.0
    bytes: int = 0  # payload bytes of the last apply
    versions_skipped: int = 0  # published between two applies, never applied here (a late joiner is not behind)
    mapped: int = 0  # tensors the last apply mapped from the version file instead of copying (shm)


class _Closable(contextlib.AbstractContextManager):
    """An ABC with idempotent ``close()`` (``_close`` is the transport's part), also on leaving ``with``."""

    _closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:
        """The transport's part: nothing by default."""

    def __exit__(self, *exc):
        self.close()


class Publisher(_Closable):
    """Learner side. ``_write`` returns the payload bytes, or None when the transport dropped that version
    (cuda_ipc, every slot in use): ``publish`` then returns None; a delta transport's ``_write_delta`` too."""

    transport = "?"
    _write_delta = None

    def __init__(self, header: WeightUpdateHeader):
        self.header = layout.with_version(header, -1)
        self.last_stats: PublishStats | None = None
        self._last_version, self.skipped = -1, 0
        self.delta: delta.Encoder | None = None  # use_delta()
        self.cast: torch.dtype | None = None  # the dtype published (the actors'), where it differs from the learner's
        self.sent = self.versions = self.fulls = 0  # bytes and versions published, how many of them full

    def use_delta(self, full_every: int, cast: torch.dtype | None = None) -> None:
        """Publish versions as deltas (weightsync/delta.py), in ``cast`` where given (the layout was made in it)."""
        if self._write_delta is None:
            raise ValueError(f"the {self.transport} transport sends no deltas")
        self.delta, self.cast = delta.Encoder(full_every), cast

    def publish(self, version: int, named: Mapping[str, torch.Tensor]) -> PublishStats | None:
        if self._closed:
            raise RuntimeError(f"{self.transport} publisher is closed")
        if version < 0 or version <= self._last_version:
            raise ValueError(f"versions must increase: got {version} after {self._last_version} (ARCHITECTURE.md, "
                             "Versions and staleness: a version is published once, after the step that made it)")
        t0 = time.perf_counter()
        named = cast_floats(named, self.cast)
        layout.check_targets(self.header, named, role=f"{self.transport} publisher", same_dtype=True)
        with torch.no_grad():
            tensors = [named[n] for n in self.header.names] if self.delta else []
            d = self.delta.encode(version, tensors) if self.delta else None
            nbytes = self._write(version, named) if d is None else self._write_delta(*d)
            if nbytes is not None and self.delta:
                self.delta.commit(version, tensors, full=d is None)
        self._last_version = version
        if nbytes is None:
            self.skipped += 1
            return None
        self.sent, self.versions, self.fulls = self.sent + nbytes, self.versions + 1, self.fulls + (d is None)
        self.last_stats = PublishStats(version, nbytes, time.perf_counter() - t0)
        return self.last_stats

    @classmethod
    def from_config(cls, cfg, run_dir: str, template: Mapping[str, torch.Tensor], *, stop=None) -> "Publisher":
        return cls(run_dir, template, cfg.weightsync.bucket_mb << 20)

    @abc.abstractmethod
    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int | None:
        ...

    def metrics(self) -> dict[str, float]:
        s, full = self.last_stats, layout.payload_nbytes(self.header)
        out = {"weightsync/publish_s": s.seconds if s else 0.0, "weightsync/bytes": float(s.bytes) if s else 0.0,
               "weightsync/publishes_skipped": float(self.skipped),
               "weightsync/bytes_per_version": self.sent / max(1, self.versions)}
        if self.delta is not None:  # the mean against a full publish, and what the last step changed
            out |= {"weightsync/sent_frac": self.sent / max(1, self.versions * full),
                    "weightsync/changed_frac": self.delta.changed_frac, "weightsync/full_versions": float(self.fulls)}
        return out


class Subscriber(_Closable):
    """Actor side. ``_apply(named, after)`` copies (or maps) the newest complete version newer
    than ``after`` into ``named`` and returns ``(version, payload bytes)``, or None."""

    transport = "?"

    def __init__(self):
        self.stats = SubscriberStats()

    @classmethod
    def from_config(cls, cfg, run_dir: str, timeout_s: float, *, stop, device, actor_id: str) -> Subscriber:
        return cls(run_dir, timeout_s, device=device, stop=stop)

    @abc.abstractmethod
    def latest_version(self) -> int:
        ...

    def apply(self, named: Mapping[str, torch.Tensor]) -> int | None:
        if self._closed:
            raise RuntimeError(f"{self.transport} subscriber is closed")
        t0 = time.perf_counter()
        with torch.no_grad():
            got = self._apply(named, self.stats.last_version)
        if got is None:
            return None
        (version, nbytes), s = got, self.stats
        s.versions_skipped += version - s.last_version - 1 if s.last_version >= 0 else 0
        s.last_version, s.apply_s, s.bytes = version, time.perf_counter() - t0, nbytes
        s.apply_s_total += s.apply_s
        return version

    @abc.abstractmethod
    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        ...

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {"weightsync/apply_s": s.apply_s, "weightsync/apply_s_total": s.apply_s_total,
                "weightsync/bytes": float(s.bytes), "weightsync/versions_skipped": float(s.versions_skipped)}


class Stopped(RuntimeError):
    """A wait given up because the caller's ``stop`` flag was set (a SIGTERM during start-up)."""


def wait_until(ready, timeout_s: float, what: str, poll_s: float = 0.05, stop=None):
    """Poll ``ready()`` until it is truthy; TimeoutError naming ``what``, or Stopped once ``stop`` is set."""
    stopped = (lambda: False) if stop is None else getattr(stop, "is_set", stop)
    deadline = time.monotonic() + timeout_s
    while True:
        if stopped():
            raise Stopped(f"stopped while waiting for {what}")
        if got := ready():
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        getattr(stop, "wait", time.sleep)(poll_s)  # an Event wakes the moment it is set


def cast_floats(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> Mapping[str, torch.Tensor]:
    return named if dtype is None else {k: v.to(dtype) if v.is_floating_point() else v for k, v in named.items()}


def make_publisher(cfg, run_dir: str, template: Mapping[str, torch.Tensor], *, stop=None) -> Publisher:
    """The learner's publisher for ``cfg.weightsync.transport``; ``template`` fixes the layout (in the
    actors' dtype when versions go as deltas: ``weightsync.delta``)."""
    on, dtype = delta_plan(cfg)
    cast = layout.torch_dtype(dtype) if on and dtype else None
    pub = resolve(PUBLISHERS, cfg.weightsync.transport, "weightsync transport").from_config(
        cfg, run_dir, cast_floats(template, cast), stop=stop)
    if on:
        pub.use_delta(cfg.weightsync.full_every, cast)
    return pub


def make_subscriber(cfg, run_dir: str, timeout_s: float = 60, *, stop=None, device=None, actor_id: str = ""):
    """An actor's subscriber; waits up to ``timeout_s`` for the publisher. ``device``: the actor's
    own (core/placement.py: actor_device), where nccl and cuda_ipc put what they receive."""
    cls = resolve(SUBSCRIBERS, cfg.weightsync.transport, "weightsync transport")
    return cls.from_config(cfg, run_dir, timeout_s, stop=stop, device=device, actor_id=actor_id)
