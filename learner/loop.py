"""Learner process: sample -> recompute log-probs -> loss -> optimiser step -> publish -> mark consumed.
A bad batch (fails validation, NaN loss, bad id) is dropped and counted, never fatal, until
``MAX_SKIPS_IN_A_ROW`` in a row. Each step's keys are fsynced to ``trained_keys.jsonl`` before its
version is published; a restart or a guard-rail rollback resumes from the newest intact checkpoint,
publishes above the newest version ever published and never trains a group sampled by discarded
weights (ARCHITECTURE.md: Recovery, Control). Exit 75 (``EXIT_WRITE_FAILED``) when a write fails.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import time
from itertools import zip_longest

import numpy as np
import torch

from buffer.client import LearnerClient
from core import config as C
from core import heartbeat
from core import funnel
from core import messages as M
from core.metrics import MetricsWriter
from core.proc import (EXIT_CORRUPT_LOG, EXIT_WRITE_FAILED, die_with_parent, learner_state_mb, memory_mb,
                       setup_logging, stop_event)
from core.stats import dense_histogram
from learner import audit, checkpoint, cp_group, tail
from learner.backends import NonFiniteError, make_backend
from learner.batching import collate
from learner.control import Control, Poisoned
from weightsync import check_devices
from weightsync.base import make_publisher

log = logging.getLogger("driftrl.learner")
MAX_SKIPS_IN_A_ROW = 20
ROLLBACKS = "rollbacks.jsonl"  # one line per rollback: the versions whose data is never trained


class LearnerLoop:
    def __init__(self, cfg: C.Config, run_dir: str, stop=None, client=None, metrics=None):
        self.cfg, self.run_dir, self.stop = cfg, run_dir, stop
        check_devices(cfg)  # as run.py checks it, so a learner started by hand fails the same way
        self.backend = _backend(cfg)
        self.state_mb = learner_state_mb(sum(p.numel() for p in self.backend.model.parameters()))
        self.ckpt_root = os.path.join(run_dir, "checkpoints")
        self.counts = collections.Counter()  # dropped_stale, skipped_batches, ... (see _emit)
        self.lost_by_len = collections.Counter()  # groups dropped or skipped, by response length
        self._funnel_sent: dict | None = None
        self._recover()
        self.control = Control(cfg.control, cfg.buffer.max_staleness, start_step=self.step)
        self.poisoned = Poisoned(read_rollbacks(run_dir))
        self.publisher = make_publisher(cfg, run_dir, self.backend.named_tensors(), stop=stop)
        # its Hello tells the buffer which weights this learner holds: what it trained since is served again
        self.client = client or LearnerClient(cfg, run_dir=run_dir, stop=stop, step=self.step,
                                              version=self._ckpt_version)
        self.metrics = metrics or MetricsWriter(run_dir, "learner", "learner0")
        self.tail = tail.writer_for(cfg, run_dir)  # run_dir/tail.jsonl; None when learner.tail_k = 0
        self.stale_hist: list[float] = []
        self.window = collections.deque(maxlen=10)  # (wait_s, busy_s) of recent steps
        self._skips_in_a_row = 0

    def _recover(self) -> None:
        """Newest intact checkpoint (or the initial weights) + the audit: see the docstring."""
        self._covered = -1  # every step up to here is in a checkpoint a fallback can load
        path = checkpoint.latest(self.ckpt_root)
        if path is None and checkpoint.complete_checkpoints(self.ckpt_root):
            raise checkpoint.DamagedCheckpoint(
                f"every checkpoint in {self.ckpt_root} is damaged (see the warnings above): the learner "
                "does not start over from the initial weights unasked; move that directory aside to start over")
        meta = checkpoint.load(path, self.backend) if path else {"step": 0, "version": 0}
        self.step, self._ckpt_version = meta["step"], meta["version"]
        self.consumed_groups = meta.get("consumed_groups", 0)
        self._ckpt_step: int | None = self.step if path else None
        rec = audit.recover(self.run_dir, self.step, self._ckpt_version)
        self.version, self.retired = rec.version, rec.retired
        self._ckpt_at = time.time()
        if path or rec.rolled_back_steps:
            log.info("resumed from %s at step %d version %d (checkpoint version %d): %d steps rolled back, "
                     "their groups served again by the buffer", path or "the initial weights", self.step,
                     self.version, self._ckpt_version, rec.rolled_back_steps)

    def publish(self) -> dict[str, float]:
        stats = self.publisher.publish(self.version, self.backend.named_tensors())
        return {k: float(v) for k, v in self.publisher.metrics().items()} if stats is not None else {}

    def budget_left(self, t_start: float) -> bool:
        r = self.cfg.run
        return not ((r.max_steps and self.step >= r.max_steps) or (self.stop is not None and self.stop.is_set())
                    or (r.max_time_s and time.time() - t_start >= r.max_time_s))

    def run(self, t_start: float | None = None) -> None:
        """Train until the budget is spent, counted from ``t_start`` (the launch: a restart gets no fresh budget)."""
        self.publish()
        t_start = time.time() if t_start is None else t_start
        log.info("learner ready at version %d", self.version)
        while self.budget_left(t_start):
            heartbeat.beat(self.run_dir, "learner")  # the launcher's hung-role check
            t0 = time.time()
            groups = self._fetch(t_start)
            if groups is None:
                break
            t1 = time.time()
            m, batch = self.train_step(groups)
            if m is None:
                continue
            self.window.append((t1 - t0, time.time() - t1))
            self._emit(m, batch, *self.window[-1], t_start)
            r = self.cfg.run
            if (r.ckpt_every and self.step % r.ckpt_every == 0) or (
                    r.ckpt_every_s and time.time() - self._ckpt_at >= r.ckpt_every_s):
                self.save()
        if self._ckpt_step != self.step:
            self.save()
        if self._funnel() != self._funnel_sent:  # the last fetch's drops too: the books close
            self.metrics.emit(self.step, self._books())
        checkpoint.save_model(self.backend, os.path.join(self.run_dir, "final_model"))
        log.info("learner finished at step %d version %d", self.step, self.version)

    def _fetch(self, t_start: float):
        """The buffer's groups until a full batch of fresh-enough ones is there (or the budget ends)."""
        want = self.cfg.learner.groups_per_step
        groups = []
        while len(groups) < want and self.budget_left(t_start):
            heartbeat.beat(self.run_dir, "learner")  # waiting for data is not hung
            batch = self.client.sample(want - len(groups), self.version, timeout_s=0.5, **self._control_request())
            if batch is None and self.control.paused:  # the buffer has no full batch left to give
                self.control.resume()
                log.info("actors resume: the buffer has no full batch left while they are paused")
            for g in batch.groups if batch is not None else ():
                if g.key in self.retired:  # in the checkpoint: trained before a crash that lost its Consumed
                    self.client.consumed([g.key], self.version, self._ckpt_step or 0)
                elif self._fresh(g):
                    groups.append(g)
        return groups if len(groups) == want else None

    def _control_request(self) -> dict:
        """The control state the next SampleRequest carries (only what departs from the config)."""
        out = {"max_staleness": self.control.max_staleness} if self.control.controller is not None else {}
        if self.control.paused:
            out["pause_actors"] = True
        if self._covered >= 0:
            out["covered_step"] = self._covered
        return out

    def _fresh(self, g: M.RolloutGroup) -> bool:
        """Within the staleness bound at the current version (counted and retired when not)."""
        lag = M.staleness(self.version, g.min_version())
        if lag < 0:  # a token from a version not yet published: corrupt, never train on it
            log.warning("group %s has tokens of version %d > learner version %d: dropped",
                        g.key, g.min_version(), self.version)
            return self._lost([g], "dropped_invalid")
        if lag > self.control.max_staleness:
            return self._lost([g], "dropped_stale")  # the buffer should have caught it; never train on it
        if self.poisoned.intervals and self.poisoned.hit(
                np.frombuffer(b"".join([c.versions for c in g.completions]), M.VERSION_DTYPE)):
            return self._lost([g], "dropped_rolled_back")  # sampled by weights a rollback discarded
        return True

    def _lost(self, groups: list[M.RolloutGroup], reason: str) -> bool:
        """Count groups that will not be trained (the discard funnel, core/funnel.py) and tell the buffer; False."""
        self.counts[reason] += len(groups)
        self.lost_by_len.update(funnel.length_bucket(g.length()) for g in groups)
        self.client.consumed([g.key for g in groups], self.version)
        return False

    def _funnel(self) -> dict[str, float]:
        """The discard funnel's learner counts."""
        c = self.counts
        return {"funnel/trained": float(self.consumed_groups), **funnel.lost_metrics(
            {"stale_at_learner": c["dropped_stale"], "invalid": c["dropped_invalid"],
             "rolled_back": c["dropped_rolled_back"], "skipped": c["skipped_groups"]}, self.lost_by_len)}

    def _books(self, *counts: str) -> dict[str, float]:
        """Step, version, the named ``counts`` and the discard funnel (remembered as the one emitted)."""
        self._funnel_sent = self._funnel()
        return {"learner/step": float(self.step), "learner/version": float(self.version),
                **{f"learner/{k}": float(self.counts[k]) for k in counts}, **self._funnel_sent}

    def train_step(self, groups: list[M.RolloutGroup]):
        """One optimiser step on ``groups`` -> ``(metrics, batch)``; ``(None, None)`` if skipped."""
        try:
            batch = collate(groups, self.version, vocab_size=self.cfg.model.vocab_size)
            m = self.backend.step(batch, self._check)
        except Exception as e:  # noqa: BLE001 -- any failure of one batch must not end the run
            self._skip(groups, e)
            return None, None
        self._skips_in_a_row = 0
        self._on_verdict(self._verdict, groups)
        if self._verdict.blocks_step:
            self._emit_control()
            return None, None
        self.version += 1
        self.step += 1
        audit.append(self.run_dir, self.step, self.version, batch.keys)  # durable before it is published
        m.update(self.publish())
        self.client.step, self.client.version = self.step, self.version
        self.client.consumed(batch.keys, self.version, self.step)
        self.consumed_groups += len(batch.keys)
        return m, batch

    def _check(self, m: dict) -> bool:
        """``Backend.step``'s check: the guard-rails before the optimiser (the verdict kept)."""
        self._verdict = self.control.observe(self.step + 1, m)
        return self._verdict.blocks_step

    def _on_verdict(self, verdict, groups: list[M.RolloutGroup]) -> None:
        """Log the staleness decision and carry out the guard action (see the module docstring)."""
        d = verdict.decision
        if d is not None and d.changed:
            log.info("staleness limit at step %d: %s", self.step + 1, d.reason)
        if self.control.after_step(verdict):
            log.info("actors resume: %d clean steps since the pause", self.cfg.control.pause_steps)
        if not verdict.trips:
            return
        log.warning("guard-rail at step %d version %d (%s): %s", self.step + 1, self.version,
                    verdict.action, verdict.reason())
        if verdict.action == "pause_actors":
            self.control.pause()
        elif verdict.action == "skip_step":
            self._lost(groups, "skipped_groups")
        elif verdict.action == "rollback":
            self._rollback(groups)

    def _rollback(self, groups: list[M.RolloutGroup]) -> None:
        """Back to the newest checkpoint (or the initial weights); see the module docstring."""
        self._lost(groups, "dropped_rolled_back")  # the batch that fired: never trained
        upto, path = self.version, checkpoint.latest(self.ckpt_root)
        after = int(checkpoint.read_meta(path)["version"]) if path else 0
        audit.append_durable(os.path.join(self.run_dir, ROLLBACKS), "the rollback record",  # durable first
                             [{"step": self.step, "after": after, "upto": upto, "time": time.time()}])
        self.poisoned.add(after, upto)
        if path is None:  # no checkpoint yet: the initial weights, rebuilt as at the start
            self.backend = _backend(self.cfg)
        self._recover()
        # above every version published, trained or not (a second rollback before any step: the first's)
        self.version = max(self.version, upto + 1)
        self.client.restart(self.step, self._ckpt_version)  # the buffer serves again what was trained since
        self.publish()
        log.warning("rolled back to %s: step %d, now version %d; groups with tokens of versions %d..%d "
                    "are dropped", path or "the initial weights", self.step, self.version, after + 1, upto)

    def _emit_control(self) -> None:
        """A step that trained nothing still reports the control state and its counts."""
        self.metrics.emit(self.step, {**self._books("dropped_rolled_back", "skipped_batches"),
                                      **self.control.metrics()})

    def _skip(self, groups: list[M.RolloutGroup], err: Exception) -> None:
        self._skips_in_a_row += 1
        self.counts["skipped_batches"] += 1
        self._lost(groups, "skipped_groups")
        kind = "non-finite" if isinstance(err, NonFiniteError) else type(err).__name__
        log.warning("batch of %d groups skipped at version %d (%s): %s", len(groups), self.version, kind, err)
        self._emit_control()  # seen now, not with the next step that trains
        if self._skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise RuntimeError(f"{self._skips_in_a_row} batches in a row failed; the last: {err}") from err

    def save(self) -> str:
        meta = {"version": self.version, "stage": "rl", "consumed_groups": self.consumed_groups,
                "data_position": self.consumed_groups}
        path = checkpoint.save(self.ckpt_root, self.step, self.backend, meta)
        # the buffer may forget what the checkpoint before this one holds (that one is the fallback)
        self._covered = self._ckpt_step if self._ckpt_step is not None else -1
        self._ckpt_step, self._ckpt_at = self.step, time.time()
        return path

    def _emit(self, m: dict, batch, wait_s: float, busy_s: float, t_start: float) -> None:
        st = batch.staleness.tolist()
        self.stale_hist = [a + b for a, b in zip_longest(self.stale_hist, dense_histogram(st), fillvalue=0.0)]
        waits = sum(w for w, _ in self.window)
        total = sum(w + b for w, b in self.window)
        m.update({
            **self._books("dropped_stale", "dropped_rolled_back", "dropped_invalid", "skipped_batches"),
            "learner/tokens_per_s": batch.num_tokens / max(busy_s, 1e-9),
            "learner/samples_per_s": len(st) / max(wait_s + busy_s, 1e-9),
            "learner/idle_frac": waits / max(total, 1e-9),
            "learner/step_s": busy_s,
            "learner/wait_s": wait_s,
            # groups of the batch with zero advantages (all rewards equal): 0 while the actors leave them out
            "learner/uniform_groups": float((batch.rewards == batch.rewards[:, :1]).all(dim=1).sum()),
            "learner/skipped_nonfinite": float(self.backend.skipped_nonfinite),
            **{f"learner/{k}": mb for k, mb in memory_mb().items()},
            "learner/state_mb": self.state_mb,
            **self.control.metrics(),
            "staleness/mean": sum(st) / len(st),
            "staleness/max": float(max(st)),
            "staleness/hist": list(self.stale_hist),
            "time/elapsed_s": time.time() - t_start,
        })
        self.metrics.emit(self.step, m)
        if self.tail is not None:
            # the version whose weights scored the batch (the one its staleness counts from)
            self.tail.write(self.step, self.version - 1, batch, self.backend.last_logp)

    def close(self) -> None:
        for part in (self.client, self.publisher, self.metrics):
            try:
                part.close()
            except Exception:  # closing is best effort; the data is already safe on disk
                log.exception("close failed")


def _backend(cfg: C.Config):
    """The backend of the initial weights; with context parallelism, rank 0's (learner/cp_group.py)."""
    return (cp_group.leader if cfg.learner.context_parallel > 1 else make_backend)(cfg, cfg.model.path)


def read_rollbacks(run_dir: str) -> list[tuple[int, int]]:
    """``(after, upto)`` version intervals of every rollback so far (a line torn by a crash: none)."""
    return [(rec["after"], rec["upto"]) for rec in audit.read(os.path.join(run_dir, ROLLBACKS))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--t0", type=float, default=None, help="the launch time (the time budget counts from it)")
    args = ap.parse_args(argv)
    die_with_parent()
    setup_logging("learner")
    stop = stop_event()
    with open(os.path.join(args.run_dir, "config.json"), "rb") as f:
        cfg = C.from_json(f.read())
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.run.seed)
    loop = None
    try:
        loop = LearnerLoop(cfg, args.run_dir, stop)
        loop.run(args.t0)
    except cp_group.RankLost as e:  # one line, not a traceback: the launcher restarts the group
        log.error("%s", e)
        sys.exit(1)
    except (checkpoint.WriteError, checkpoint.DamagedCheckpoint) as e:
        code = EXIT_WRITE_FAILED if isinstance(e, checkpoint.WriteError) else EXIT_CORRUPT_LOG
        log.error("%s (exit %d)", e, code)
        sys.exit(code)
    finally:
        if loop is not None:
            loop.close()


if __name__ == "__main__":
    main()
