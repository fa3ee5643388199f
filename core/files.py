"""The one place driftrl makes a file or a directory appear atomically and durably: a reader sees the old content or
the new, never half of it (temporary name, fsync, rename, fsync the directory)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil


def fsync_path(path: str) -> None:
    """fsync a file or a directory (which makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, durable: bool = True, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (fsynced if ``durable``);
    ``mode`` (e.g. 0o600 for a secret) is set before any byte is written."""
    tmp = f"{path}.tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a crashed writer's leftover; O_EXCL below must not meet it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    if mode is not None:
        os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask
    with open(fd, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(os.path.dirname(os.path.abspath(path)))


def atomic_dir(final: str, write, marker: str) -> str:
    """Call ``write(tmp_dir)``, then make its result appear at ``final`` atomically (an existing one is
    renamed aside meanwhile); ``marker`` is written last, so a reader requiring it never sees half."""
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    base = os.path.basename(final)
    tmp = os.path.join(parent, f".tmp-{base}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write(tmp)
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                fsync_path(os.path.join(root, name))
            fsync_path(root)
        old = os.path.join(parent, f".old-{base}-{os.getpid()}")
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        atomic_write(os.path.join(final, marker), b"ok\n")
        fsync_path(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_json(path: str) -> dict | None:
    """The JSON file, or None while it is missing or half written (what a waiter polls for)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def run_file(run_dir: str, name: str, why_missing: str) -> str:
    """``run_dir/name``; FileNotFoundError when it or the run directory is not there."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} has no {name}: {why_missing}")
    return path
