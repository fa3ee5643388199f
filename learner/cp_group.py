"""A learner's context-parallel rank group (``learner.context_parallel`` > 1; ARCHITECTURE.md: Precision and
the ratio). Rank 0, the learner role's process, starts the others as its children, so a launcher sees one role;
each backend call that runs collectives is broadcast to them as tensors (nothing pickled) and mirrored. Of what
a step decides only the guard-rails' verdict travels so; the rest (a non-finite loss) is computed alike on each rank.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import subprocess
import sys
import time

import msgspec
import torch
import torch.distributed as dist

from core import config as C
from core import net, placement
from core.proc import die_with_parent, setup_logging
from learner import checkpoint
from learner.backends import make_backend
from learner.batching import TENSORS, Batch

log = logging.getLogger("driftrl.learner")
STEP, LOAD, REBUILD, STOP = range(4)
MAX_PATH = 4096
DEATH_WAIT_S = 5.0  # a rank killed mid-collective: how long rank 0 waits to see it gone
_followers: list[subprocess.Popen] = []


class RankLost(BaseException):
    """A rank of the group died: the learner must restart whole (a BaseException: never a skipped batch)."""


def leader(cfg: C.Config, model_dir: str):
    """Rank 0's backend (:class:`Leader`): the first call starts the other ranks and joins the group,
    a later one (a rollback to the initial weights) has them rebuild theirs too."""
    if not _followers:
        _start_followers(cfg)
    else:
        _command(REBUILD, model_dir)
    return Leader(make_backend(cfg, model_dir))


def _start_followers(cfg: C.Config) -> None:
    size = cfg.learner.context_parallel
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(net.free_port()),
           "WORLD_SIZE": str(size), "DRIFTRL_LAUNCHER_PID": str(os.getpid())}
    config_json, dev = os.path.join(cfg.run.run_dir, "config.json"), placement.learner_device(cfg)
    if dev.type == "cuda" and dev.index + size > torch.cuda.device_count():  # NCCL: one device per rank
        raise RuntimeError(f"learner.context_parallel={size} from {dev} needs GPUs {dev.index}.."
                           f"{dev.index + size - 1}; this host has {torch.cuda.device_count()}")
    for rank in range(1, size):
        device = ["--device", f"cuda:{dev.index + rank}"] if dev.type == "cuda" else []
        _followers.append(subprocess.Popen([sys.executable, "-m", "learner.cp_group", "--config", config_json, *device],
                                           env={**env, "RANK": str(rank)}, stdin=subprocess.DEVNULL))
    os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}, RANK="0")
    atexit.register(_stop_followers)
    log.info("context parallel: ranks 1..%d started (pids %s)", size - 1, [p.pid for p in _followers])


def _stop_followers() -> None:
    if dist.is_initialized() and all(p.poll() is None for p in _followers):
        try:
            _command(STOP)
        except Exception as e:  # noqa: BLE001 -- a rank already gone: the rest end with this process
            log.info("context-parallel ranks not told to stop (%s): they end with this process", e)
    for p in _followers:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


class Leader:
    """Rank 0's backend: the backend's own, each collective call announced to the other ranks first."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # named_tensors, save_*, last_logp, skipped_nonfinite, ...
        return getattr(self.inner, name)

    def step(self, batch: Batch, check=None) -> dict[str, float]:
        if lost := [p.pid for p in _followers if p.poll() is not None]:
            raise RankLost(f"context-parallel rank process(es) {lost} exited: the learner restarts whole")
        try:
            _command(STEP)
            _send_batch(batch)
            return self.inner.step(batch, lambda m: _decide(bool(check(m)) if check else False))
        except Exception as e:
            deadline = time.monotonic() + DEATH_WAIT_S
            while time.monotonic() < deadline and all(p.poll() is None for p in _followers):
                time.sleep(0.05)
            if any(p.poll() is not None for p in _followers):
                raise RankLost(f"a context-parallel rank died during a step: {e}") from e
            raise

    def load_state(self, path: str, meta: dict) -> None:
        _command(LOAD, path)
        self.inner.load_state(path, meta)


def _command(cmd: int, path: str = "") -> None:
    raw = path.encode()
    if len(raw) > MAX_PATH:
        raise ValueError(f"path of {len(raw)} bytes: at most {MAX_PATH}")
    dist.broadcast(torch.tensor([cmd, len(raw)], dtype=torch.int64), 0)
    if raw:
        dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0)


def _recv_command() -> tuple[int, str]:
    head = torch.empty(2, dtype=torch.int64)
    dist.broadcast(head, 0)
    cmd, n = head.tolist()
    raw = torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(raw, 0)
    return cmd, bytes(raw.tolist()).decode()


def _decide(flag: bool) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.broadcast(t, 0)
    return bool(t.item())


def _send_batch(b: Batch) -> None:
    has = b.versions is not None
    dist.broadcast(torch.tensor([*b.ids.shape, *b.rewards.shape, int(has), b.num_tokens], dtype=torch.int64), 0)
    for name in TENSORS[: len(TENSORS) - (not has)]:
        t = getattr(b, name)
        dist.broadcast((t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous(), 0)


def _recv_batch() -> Batch:
    head = torch.empty(6, dtype=torch.int64)
    dist.broadcast(head, 0)
    n, length, groups, size, has, num_tokens = head.tolist()
    shapes = {"ids": ((n, length), torch.int64), "key_mask": ((n, length), torch.uint8),
              "mask": ((n, length - 1), torch.float32), "behaviour_logp": ((n, length - 1), torch.float32),
              "rewards": ((groups, size), torch.float32), "staleness": ((n,), torch.int64),
              "versions": ((n, length - 1), torch.int64)}
    got = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()
           if has or name != "versions"}
    for t in got.values():
        dist.broadcast(t, 0)
    got["key_mask"] = got["key_mask"].bool()
    return Batch(**got, keys=[], num_tokens=num_tokens)  # keys and group ids stay with rank 0


def follow(cfg: C.Config) -> None:
    """Make rank 0's calls until it says stop (or is gone: a collective fails and this process ends)."""
    backend = make_backend(cfg, cfg.model.path)
    while True:
        cmd, path = _recv_command()
        if cmd == STOP:
            return
        if cmd == LOAD:
            backend.load_state(path, checkpoint.read_meta(path))
        elif cmd == REBUILD:
            backend = make_backend(cfg, path)
        elif cmd == STEP:
            batch = _recv_batch()
            try:
                backend.step(batch, lambda m: _decide(False))
            except Exception as e:  # noqa: BLE001 -- computed alike on rank 0, which decides what follows
                log.warning("step failed as on rank 0: %s", e)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="a learner's context-parallel rank (started by rank 0)")
    ap.add_argument("--config", required=True, help="RUN_DIR/config.json")
    ap.add_argument("--device", default=None, help="this rank's GPU (rank 0's index + rank)")
    args = ap.parse_args(argv)
    die_with_parent()  # DRIFTRL_LAUNCHER_PID is rank 0: this rank ends with it
    setup_logging(f"learner-rank{os.environ.get('RANK', '?')}")
    with open(args.config, "rb") as f:
        cfg = C.from_json(f.read())
    if args.device:
        cfg = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner, device=args.device))
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.run.seed)
    follow(cfg)


if __name__ == "__main__":
    main()
