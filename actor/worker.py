"""Rollout worker: sample G completions per prompt, score them, stream RolloutGroups to the buffer.

Loop: adopt the newest weights -> wait for admission (core/admission.py, following the learner's
control as the buffer passes it on) -> generate (weights may change between decode steps) ->
score -> send (the buffer client keeps every group until acknowledged) -> emit metrics. Actor 0
also runs the held-out evaluation every ``run.eval_every`` versions.

Run as a process: ``python -m actor.worker --run-dir RUN_DIR --index I``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time

import msgspec
import numpy as np
import torch

from actor.curriculum import LengthCurriculum, prompt_limit, state_path
from actor.engines import EngineStopped, engine_class, make_engine
from actor.evaluate import evaluate
from actor.tasks import make_task
from buffer.client import ActorClient, Stopped as BufferStopped
from core import config as C
from core import heartbeat
from core import messages as M
from core import placement
from core.admission import Admission
from core.metrics import MetricsWriter
from core.proc import die_with_parent, setup_logging, stop_event
from model.tokenizer import Tokenizer
from weightsync.base import Stopped

log = logging.getLogger("driftrl.actor")


def tier_means(groups) -> dict[str, float]:
    """``reward/by_tier/<tier>`` and ``length/by_tier/<tier>``: means over each tier's completions."""
    rewards: dict[str, list[float]] = {}
    lengths: dict[str, list[int]] = {}
    for g in groups:
        rewards.setdefault(g.tier, []).extend(c.reward for c in g.completions)
        lengths.setdefault(g.tier, []).extend(c.num_tokens for c in g.completions)
    return {**{f"reward/by_tier/{t}": float(np.mean(r)) for t, r in rewards.items()},
            **{f"length/by_tier/{t}": float(np.mean(n)) for t, n in lengths.items()}}


class RolloutWorker:
    run_dir = ""  # set by __init__; a worker built piecemeal by a test has none (no heartbeat)
    curriculum: LengthCurriculum | None = None  # likewise: none means actor.max_new_tokens throughout

    def __init__(self, cfg: C.Config, run_dir: str, index: int, stop=None):
        self.cfg, self.run_dir, self.index = cfg, run_dir, index
        self.actor_id = f"actor{index}"
        self.stop = stop
        self.task = make_task(cfg.task, Tokenizer.from_dir(cfg.model.path))
        # validated here as run.py validates it, so an actor started by hand fails the same way
        self.device = placement.actor_device(cfg, index)
        a = msgspec.structs.replace(cfg.actor, device=str(self.device))
        # the engine declares how it receives the learner's weights: the worker names no engine
        source = engine_class(a.engine).weight_source
        weights = source(cfg, run_dir, self.actor_id, stop=stop, device=self.device)
        self.engine = make_engine(a, cfg.model.path, weights, seed=cfg.run.seed * 1000 + index)
        self.engine.stop = stop
        self.engine.on_step = self._beat
        self.client = ActorClient(cfg, self.actor_id, run_dir=run_dir, stop=stop)
        self.admission: Admission | None = None  # set by the first weights applied (_wait_for_weights)
        self.rng: random.Random | None = None
        self.metrics = MetricsWriter(run_dir, "actor", self.actor_id)
        self.curriculum = LengthCurriculum(cfg.actor, state_path(run_dir, self.actor_id))
        self.last_eval = -1
        self.eval_set = self.task.eval_set(cfg.run.eval_prompts) if index == 0 and cfg.run.eval_every else []

    @property
    def version(self) -> int:
        """The version every next token is tagged with (-1 before the learner's first publish)."""
        return self.engine.version

    def _wait_for_weights(self, timeout_s: float = 120.0) -> bool:
        """Wait for the first weights (False if stopped first); admission counts from their version
        (a resumed learner's is its checkpoint's: counting from 0 would start groups already stale)."""
        t0 = time.time()
        while self.engine.refresh_weights() < 0:
            if self._stopped():
                return False
            if time.time() - t0 > timeout_s:
                raise TimeoutError("no weights published by the learner")
            self._beat()
            self._sleep(0.05)
        share = self.cfg.learner.groups_per_step // self.cfg.actor.num_actors
        self.admission = Admission.resumed(share, self.cfg.buffer.max_staleness, self.version,
                                           self.client.outstanding)
        self.rng = random.Random(hash((self.cfg.run.seed, self.index, self.version)) & 0xFFFFFFFF)
        return True

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _sleep(self, seconds: float) -> None:
        """A pause that SIGTERM (the stop event) cuts short."""
        if self.stop is not None:
            self.stop.wait(seconds)
        else:
            time.sleep(seconds)

    def _beat(self) -> None:
        """Tell the launcher this loop is alive (core/heartbeat.py: a silent role is hung)."""
        if self.run_dir:
            heartbeat.beat(self.run_dir, f"actor{self.index}")

    def _return_quota(self) -> None:
        for ack in self.client.poll(0):
            if ack.status in ("rejected", "dropped"):
                self.admission.give_back()

    def _wait_for_admission(self) -> tuple[int, float]:
        t0 = time.time()
        while True:
            self._beat()
            self._return_quota()
            self._follow_control()
            n = min(self.cfg.actor.groups_per_batch, self.admission.allowed(self.engine.refresh_weights()))
            if n > 0 or self._stopped():
                return n, time.time() - t0
            self._sleep(0.005)

    def _follow_control(self) -> None:
        ctl, a = self.client.control, self.admission
        if ctl is not None and ctl != (a.max_staleness, a.paused):
            log.info("admission follows the learner: max_staleness %d, %s", ctl[0], "paused" if ctl[1] else "running")
            a.max_staleness, a.paused = ctl

    def run(self) -> None:
        if not self._wait_for_weights():
            return
        while not self._stopped():
            self._maybe_eval()
            n, waited = self._wait_for_admission()
            if n == 0:
                break
            self.admission.start(n)
            t0, sending, groups = time.time(), 0.0, []
            for group in self.generate_groups(n):  # each sent as soon as its last sample is done
                t_send = time.time()
                self.client.send_many([group])  # may wait for the buffer's window: not generation
                sending += time.time() - t_send
                groups.append(group)
            self._emit(groups, time.time() - t0 - sending, waited)
        self.client.flush(timeout_s=5.0)

    def generate_groups(self, n: int):
        """Yield ``n`` RolloutGroups in completion order, each as soon as its last sample finishes."""
        start_version = self.version
        prompts = [self.task.sample(self.rng, "train") for _ in range(n)]
        size = self.cfg.actor.group_size
        limits = self.limits(prompts, start_version)
        done: dict[int, dict] = {}
        for index, sample in self.engine.stream([list(p.tokens) for p in prompts for _ in range(size)],
                                                max_new_tokens=[b for b in limits for _ in range(size)]):
            self._beat()  # a long batch is not a hang
            if self.curriculum is not None:
                self.curriculum.observe(sample.finish_reason, limits[index // size])
            got = done.setdefault(index // size, {})
            got[index % size] = sample
            if len(got) == size:
                del done[index // size]
                yield self._group(prompts[index // size], [got[j] for j in range(size)], start_version)

    def curriculum_limit(self, version: int) -> int:
        return self.cfg.actor.max_new_tokens if self.curriculum is None else self.curriculum.limit(version)

    def limits(self, prompts, version: int) -> list[int]:
        cur = self.curriculum_limit(version)
        return [prompt_limit(self.cfg, p, cur) for p in prompts]

    def _group(self, prompt, samples, start_version: int) -> M.RolloutGroup:
        rewards = self.task.rewards([(prompt, s.tokens) for s in samples])
        return M.group_from_samples(
            samples, rewards, actor_id=self.actor_id, seq=self.client.next_seq(),
            group_id=f"{self.actor_id}-{prompt.id}", task=self.task.name, tier=prompt.tier, prompt=prompt.tokens,
            start_version=start_version, created_at=time.time())

    def _emit(self, groups, gen_s: float, waited: float) -> None:
        rewards = [c.reward for g in groups for c in g.completions]
        lengths = [c.num_tokens for g in groups for c in g.completions]
        ws = self.engine.weights.metrics()
        self.metrics.emit(self.version, {
            "actor/tokens_per_s": sum(lengths) / max(gen_s, 1e-9),
            "actor/groups_per_s": len(groups) / max(gen_s + waited, 1e-9),
            "actor/admission_wait_s": waited,
            "actor/buffer_wait_s": float(self.client.admission_wait_s),
            "actor/version": float(self.version),
            "reward/mean": float(np.mean(rewards)),
            "length/mean": float(np.mean(lengths)),
            "length/p90": float(np.percentile(lengths, 90)),
            "length/max": float(max(lengths)),
            "length/limit": float(self.curriculum_limit(self.version)),
            "length/clip_rate": float(np.mean([c.finish_reason == "length" for g in groups for c in g.completions])),
            **tier_means(groups),
            **{k: float(v) for k, v in ws.items()},
            **self.task.metrics(),
        })

    def _maybe_eval(self) -> None:
        every = self.cfg.run.eval_every
        if not self.eval_set or (self.last_eval >= 0 and self.version < self.last_eval + every):
            return
        self.last_eval = self.version
        # sampled as training samples now: the same tier limits and curriculum limit
        reward, length = evaluate(self.engine, self.task, self.eval_set, self.limits(self.eval_set, self.version))
        self.metrics.emit(self.version, {"eval/reward": reward, "eval/length": length,
                                         "eval/version": float(self.version)})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--index", type=int, default=0)
    args = ap.parse_args(argv)
    die_with_parent()
    log = setup_logging(f"actor{args.index}")
    stop = stop_event()
    with open(os.path.join(args.run_dir, "config.json"), "rb") as f:
        cfg = C.from_json(f.read())
    torch.set_num_threads(cfg.actor.threads)
    try:
        worker = RolloutWorker(cfg, args.run_dir, args.index, stop)
    except Stopped:  # SIGTERM while waiting for the learner's weight publisher
        log.info("actor %d stopped before it started", args.index)
        return
    log.info("actor %d started at version %d", args.index, worker.version)
    try:
        worker.run()
    except BufferStopped:  # SIGTERM while waiting for the buffer; unsent groups stay in the spool
        log.info("actor %d stopped while waiting for the buffer", args.index)
    except EngineStopped:  # SIGTERM mid-batch: finished groups were sent, the rest never started
        log.info("actor %d stopped mid-generation", args.index)
    finally:
        worker.client.close()
        worker.engine.close()
        worker.task.close()
        worker.metrics.close()
        log.info("actor %d stopped", args.index)


if __name__ == "__main__":
    main()
