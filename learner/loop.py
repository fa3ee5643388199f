"""Learner process: sample -> recompute log-probs -> Ring-Zero step -> publish -> mark consumed.

Versions (DESIGN §2): version 0 is the initial weights, published before the first request; each
optimiser step publishes ``version + 1``. The staleness bound is re-checked here as the last line
of defence: a sample older than ``max_staleness`` is dropped and counted, never trained on.

Run as a process: ``python -m learner.loop --run-dir RUN_DIR``; with a complete checkpoint in
``RUN_DIR/checkpoints`` it resumes from it (same version, step, optimiser and RNG state).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import time

import torch

from buffer.client import LearnerClient
from core import config as C
from core.metrics import MetricsSink
from core.proc import die_with_parent, setup_logging, stop_event
from core.stats import dense_histogram
from learner import checkpoint
from learner.backends import NonFiniteError, make_backend
from learner.batching import collate
from weightsync.base import make_publisher

log = logging.getLogger("driftrl.learner")


class LearnerLoop:
    def __init__(self, cfg: C.Config, run_dir: str, stop=None):
        self.cfg, self.run_dir, self.stop = cfg, run_dir, stop
        self.backend = make_backend(cfg, cfg.model.path)
        self.step, self.version, self.consumed_groups = 0, 0, 0
        self.ckpt_root = os.path.join(run_dir, "checkpoints")
        resume_from = checkpoint.latest(self.ckpt_root)
        if resume_from:
            meta = checkpoint.load(resume_from, self.backend)
            self.step, self.version = meta["step"], meta["version"]
            self.consumed_groups = meta.get("consumed_groups", 0)
            log.info("resumed from %s at step %d version %d", resume_from, self.step, self.version)
        self.publisher = make_publisher(cfg, run_dir, self.backend.named_tensors())
        self.client = LearnerClient(cfg)
        self.metrics = MetricsSink(cfg.net.host, cfg.net.metrics_port, "learner", "learner0")
        self.stale_hist: list[float] = []
        self.dropped_stale = 0
        self.window = collections.deque(maxlen=10)  # (wait_s, busy_s) of recent steps

    def publish(self) -> dict[str, float]:
        stats = self.publisher.publish(self.version, self.backend.named_tensors())
        return {k: float(v) for k, v in self.publisher.metrics().items()} if stats is not None else {}

    def budget_left(self, t_start: float) -> bool:
        r = self.cfg.run
        if r.max_steps and self.step >= r.max_steps:
            return False
        if r.max_time_s and time.time() - t_start >= r.max_time_s:
            return False
        return not (self.stop is not None and self.stop.is_set())

    def _fetch(self, t_start: float):
        """Block until a full batch of fresh-enough groups arrives (or the budget ends)."""
        want = self.cfg.learner.groups_per_step
        groups: list = []
        while len(groups) < want and self.budget_left(t_start):
            batch = self.client.sample(want - len(groups), self.version, timeout_s=0.5)
            if batch is None:
                continue
            for g in batch.groups:
                if self.version - g.min_version() > self.cfg.buffer.max_staleness:
                    self.dropped_stale += 1  # the buffer should have caught it; never train on it
                    self.client.consumed([g.key], self.version)
                else:
                    groups.append(g)
        return groups if len(groups) == want else None

    def run(self) -> None:
        self.publish()
        t_start = time.time()
        log.info("learner ready at version %d", self.version)
        while self.budget_left(t_start):
            t0 = time.time()
            groups = self._fetch(t_start)
            if groups is None:
                break
            t1 = time.time()
            batch = collate(groups, self.version)
            try:
                m = self.backend.step(batch)
            except NonFiniteError as e:
                log.warning("step skipped: %s", e)
                self.client.consumed(batch.keys, self.version)
                continue
            self.version += 1
            self.step += 1
            m.update(self.publish())
            self.client.consumed(batch.keys, self.version)
            self.consumed_groups += len(batch.keys)
            self._audit(batch.keys)
            t2 = time.time()
            self.window.append((t1 - t0, t2 - t1))
            self._emit(m, batch, t1 - t0, t2 - t1, t_start)
            if self.cfg.run.ckpt_every and self.step % self.cfg.run.ckpt_every == 0:
                self.save()
        self.save()
        checkpoint.save_model(self.backend, os.path.join(self.run_dir, "final_model"))
        log.info("learner finished at step %d version %d", self.step, self.version)

    def _audit(self, keys) -> None:
        """Append-only record of what each step trained on: exactly-once is checkable after the fact."""
        with open(os.path.join(self.run_dir, "trained_keys.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.step, "version": self.version, "keys": keys}) + "\n")

    def save(self) -> str:
        meta = {"version": self.version, "stage": "rl", "consumed_groups": self.consumed_groups,
                "data_position": self.consumed_groups}
        return checkpoint.save(self.ckpt_root, self.step, self.backend, meta)

    def _emit(self, m: dict, batch, wait_s: float, busy_s: float, t_start: float) -> None:
        st = batch.staleness.tolist()
        hist = dense_histogram(st)
        self.stale_hist += [0.0] * (len(hist) - len(self.stale_hist))
        for i, c in enumerate(hist):
            self.stale_hist[i] += c
        waits = sum(w for w, _ in self.window)
        total = sum(w + b for w, b in self.window)
        m.update({
            "learner/step": float(self.step),
            "learner/version": float(self.version),
            "learner/tokens_per_s": batch.num_tokens / max(busy_s, 1e-9),
            "learner/samples_per_s": len(st) / max(wait_s + busy_s, 1e-9),
            "learner/idle_frac": waits / max(total, 1e-9),
            "learner/step_s": busy_s,
            "learner/wait_s": wait_s,
            "learner/dropped_stale": float(self.dropped_stale),
            "learner/skipped_nonfinite": float(self.backend.skipped_nonfinite),
            "staleness/mean": sum(st) / len(st),
            "staleness/max": float(max(st)),
            "staleness/hist": list(self.stale_hist),
            "time/elapsed_s": time.time() - t_start,
        })
        self.metrics.emit(self.step, m)

    def close(self) -> None:
        for part in (self.client, self.publisher, self.metrics):
            try:
                part.close()
            except Exception:  # closing is best effort; the data is already safe on disk
                log.exception("close failed")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    die_with_parent()
    setup_logging("learner")
    stop = stop_event()
    with open(os.path.join(args.run_dir, "config.json"), "rb") as f:
        cfg = C.from_json(f.read())
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.run.seed)
    loop = LearnerLoop(cfg, args.run_dir, stop)
    try:
        loop.run()
    finally:
        loop.close()


if __name__ == "__main__":
    main()
