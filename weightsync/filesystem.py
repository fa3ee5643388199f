"""Filesystem transport: ``run_dir/weights/v{version}.safetensors`` plus a ``LATEST`` pointer.

For late joiners, debugging, and hosts that share only a filesystem. Every file is written to a
temporary name, fsynced and renamed (then the directory is fsynced), so a reader sees a complete
file or none; ``LATEST`` is replaced the same way after the weights file. The publisher keeps
the newest :data:`KEEP` versions, so a reader that read ``LATEST`` just before a newer publish
still finds its file; if it lost the race anyway it re-reads ``LATEST`` and tries again.

``weights/LAYOUT`` (the msgpack WeightUpdateHeader, version -1) is written when the publisher
starts: subscribers wait for it, and check their tensors against it before copying.
Each weights file carries ``version`` and ``layout`` (hash) in its safetensors metadata.
"""

from __future__ import annotations

import os
import re
import time
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.files import atomic_write, fsync_path
from core.messages import WeightUpdateHeader, decoder, encode
from weightsync import layout
from weightsync.base import Publisher, Subscriber, wait_until

KEEP = 2
_FILE_RE = re.compile(r"^v(\d+)\.safetensors$")
_header_decoder = decoder(WeightUpdateHeader)


def weights_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "weights")


def _savable(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, storage-private tensors: safetensors refuses shared storage (tied
    embeddings) and views into larger storages."""
    out, seen = {}, set()
    for name, t in named.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def versions_on_disk(run_dir: str) -> list[int]:
    try:
        names = os.listdir(weights_dir(run_dir))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _FILE_RE.match(n)))


class FsPublisher(Publisher):
    transport = "filesystem"

    def __init__(self, run_dir: str, template: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20):
        super().__init__(layout.header_for(-1, template, bucket_bytes))
        self.run_dir = run_dir
        self.dir = weights_dir(run_dir)
        os.makedirs(self.dir, exist_ok=True)
        for n in os.listdir(self.dir):
            if ".tmp" in n:  # leftovers of a crashed writer
                os.unlink(os.path.join(self.dir, n))
        self._hash = layout.layout_hash(self.header).hex()
        atomic_write(os.path.join(self.dir, "LAYOUT"), encode(self.header))

    def _write(self, version: int, named: Mapping[str, torch.Tensor]) -> int:
        path = os.path.join(self.dir, f"v{version}.safetensors")
        tmp = f"{path}.tmp{os.getpid()}"
        save_file(_savable(named), tmp, metadata={"version": str(version), "layout": self._hash})
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(self.dir)
        atomic_write(os.path.join(self.dir, "LATEST"), f"{version}\n".encode())
        on_disk = versions_on_disk(self.run_dir)
        keep = set([v for v in on_disk if v <= version][-KEEP:])
        for old in on_disk:
            if old in keep:
                continue
            try:
                os.unlink(os.path.join(self.dir, f"v{old}.safetensors"))
            except FileNotFoundError:
                pass
        return layout.payload_nbytes(self.header)


class FsSubscriber(Subscriber):
    """Reads ``run_dir/weights``; waits up to ``timeout_s`` for a publisher's ``LAYOUT`` (or
    until ``stop`` is set: :class:`weightsync.base.Stopped`)."""

    transport = "filesystem"

    def __init__(self, run_dir: str, timeout_s: float = 60, apply_timeout_s: float = 30, poll_s: float = 0.02,
                 *, stop=None):
        super().__init__()
        self.dir = weights_dir(run_dir)
        self.apply_timeout_s = apply_timeout_s
        self.poll_s = poll_s
        self._latest_path = os.path.join(self.dir, "LATEST")
        self._latest, self._checked_at = -1, -float("inf")
        wait_until(
            lambda: os.path.exists(os.path.join(self.dir, "LAYOUT")), timeout_s,
            f"a weight publisher in {self.dir} (no LAYOUT file yet); is the learner up?", stop=stop,
        )
        self._load_layout()

    def _load_layout(self) -> None:
        with open(os.path.join(self.dir, "LAYOUT"), "rb") as f:
            self.header = _header_decoder.decode(f.read())
        self._hash = layout.layout_hash(self.header).hex()

    def latest_version(self) -> int:
        # re-read LATEST at most every poll_s: noticing a new version 20 ms late costs nothing,
        # while an open+read per decode step would (and a stat-keyed cache can be fooled by
        # inode reuse plus coarse mtimes)
        now = time.monotonic()
        if now - self._checked_at >= self.poll_s:
            self._checked_at = now
            self._latest = self._read_latest()
        return self._latest

    def _read_latest(self) -> int:
        try:
            with open(self._latest_path, "rb") as f:
                return int(f.read().strip())
        except FileNotFoundError:
            return -1

    def _apply(self, named: Mapping[str, torch.Tensor], after: int) -> tuple[int, int] | None:
        deadline = time.monotonic() + self.apply_timeout_s
        while True:
            version = self._latest = self._read_latest()
            if version <= after:
                return None
            try:
                return self._copy_file(version, named)
            except FileNotFoundError:
                # pruned between reading LATEST and opening it: newer versions exist
                if time.monotonic() > deadline:
                    raise TimeoutError(f"filesystem subscriber: v{version} vanished repeatedly") from None

    def _copy_file(self, version: int, named: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        path = os.path.join(self.dir, f"v{version}.safetensors")
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("version") != str(version):
                raise layout.LayoutError(f"{path}: metadata says version {meta.get('version')!r}")
            if meta.get("layout") != self._hash:
                self._load_layout()  # a restarted learner may have a new layout
                if meta.get("layout") != self._hash:
                    raise layout.LayoutError(f"{path}: layout hash differs from {self.dir}/LAYOUT")
            layout.check_targets(self.header, named, role="filesystem subscriber")
            for name in self.header.names:
                named[name].copy_(f.get_tensor(name))
        return version, layout.payload_nbytes(self.header)
