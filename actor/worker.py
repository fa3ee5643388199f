"""Rollout worker: sample G completions per prompt, score them, stream RolloutGroups to the buffer.

Loop: adopt the newest weights -> wait for admission (core/admission.py) -> generate -> score ->
send (kept until the buffer acknowledges) -> emit metrics; actor 0 also runs the held-out eval
every ``run.eval_every`` versions.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import random
import threading
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
from core import funnel, heartbeat, placement
from core import messages as M
from core.admission import Admission
from core.metrics import MetricsWriter
from core.proc import die_with_parent, setup_logging, stop_event
from model.tokenizer import Tokenizer
from weightsync import check_devices
from weightsync.base import Stopped

log = logging.getLogger("driftrl.actor")
# groups in a row whose rewards were all equal, left out (skip_uniform_groups); past it they are sent
# anyway: a task out of the model's reach (or mastered) must not leave the learner waiting forever
MAX_UNIFORM_IN_A_ROW = 64
SETTLE_S = 2.0  # at exit, how long the acks of the groups in flight are awaited (the launcher stops actors first)


class RolloutWorker:
    uniform = 0  # groups left out for equal rewards (skip_uniform_groups), this incarnation
    generated = 0  # groups finished by the engine, this incarnation (the funnel's top: core/funnel.py)
    _uniform_streak = 0
    _uniform_by_len: collections.Counter | None = None

    def __init__(self, cfg: C.Config, run_dir: str, index: int, stop: threading.Event | None = None):
        self.cfg, self.run_dir, self.index = cfg, run_dir, index
        self.actor_id = f"actor{index}"
        self.stop = stop or threading.Event()  # set by SIGTERM (core.proc.stop_event)
        self.task = make_task(cfg.task, Tokenizer.from_dir(cfg.model.path))
        # validated here as run.py validates it, so an actor started by hand fails the same way
        self.device = placement.actor_device(cfg, index)
        check_devices(cfg)  # the transport's device rules too, as run.py checks them
        a = msgspec.structs.replace(cfg.actor, device=str(self.device))
        weights = engine_class(a.engine).weight_source(cfg, run_dir, self.actor_id, stop=self.stop, device=self.device)
        self.engine = make_engine(a, cfg.model.path, weights, seed=cfg.run.seed * 1000 + index)
        self.engine.stop = self.stop
        self.engine.on_step = self._beat
        self.client = ActorClient(cfg, self.actor_id, run_dir=run_dir, stop=self.stop)
        self.admission: Admission | None = None  # set by the first weights applied (_wait_for_weights)
        self.rng: random.Random | None = None  # seeded by the first weights' version
        self.metrics = MetricsWriter(run_dir, "actor", self.actor_id)
        self.curriculum = LengthCurriculum(cfg.actor, state_path(run_dir, self.actor_id))
        self.last_eval = -1
        self.eval_set = self.task.eval_set(cfg.run.eval_prompts) if index == 0 and cfg.run.eval_every else []

    def _wait_for_weights(self, timeout_s: float = 120.0) -> bool:
        """Wait for the first weights (False if stopped first); admission counts from their version
        (a resumed learner's is its checkpoint's: counting from 0 would start groups already stale)."""
        t0 = time.time()
        while self.engine.refresh_weights() < 0:
            if self.stop.is_set():
                return False
            if time.time() - t0 > timeout_s:
                raise TimeoutError("no weights published by the learner")
            self._beat()
            self.stop.wait(0.05)  # SIGTERM cuts the pause short
        share = self.cfg.learner.groups_per_step // self.cfg.actor.num_actors
        self.admission = Admission.resumed(share, self.cfg.buffer.max_staleness, self.engine.version,
                                           self.client.outstanding)
        self.rng = random.Random(hash((self.cfg.run.seed, self.index, self.engine.version)) & 0xFFFFFFFF)
        return True

    def _beat(self) -> None:  # core/heartbeat.py: a role silent for too long is hung
        heartbeat.beat(self.run_dir, self.actor_id)

    def _wait_for_admission(self) -> tuple[int, float]:
        t0 = time.time()
        while True:
            self._beat()
            for ack in self.client.poll(0):  # a group the buffer refused frees its share
                if ack.status in ("rejected", "dropped"):
                    self.admission.give_back()
            ctl, a = self.client.control, self.admission
            if ctl is not None and ctl != (a.max_staleness, a.paused):
                log.info("admission follows the learner: max_staleness %d, %s", ctl[0],
                         "paused" if ctl[1] else "running")
                a.max_staleness, a.paused = ctl
            n = min(self.cfg.actor.groups_per_batch, self.admission.allowed(self.engine.refresh_weights()))
            if n > 0 or self.stop.is_set():
                return n, time.time() - t0
            self.stop.wait(0.005)

    def run(self) -> None:
        if not self._wait_for_weights():
            return
        while not self.stop.is_set():
            self._maybe_eval()
            n, waited = self._wait_for_admission()
            if n == 0:
                break
            self.admission.start(n)
            self.client.in_flight(self.engine.version)  # buffer.stale_strategy = wait holds the learner for them
            t0, sending, groups = time.time(), 0.0, []
            for group in self.generate_groups(n):  # each sent as soon as its last sample is done
                groups.append(group)
                t_send = time.time()
                self._hand_over(group)  # may wait for the buffer's window: not generation
                sending += time.time() - t_send
            self.client.in_flight(-1)
            self._emit(groups, time.time() - t0 - sending, waited)
        self.client.flush(timeout_s=5.0)

    def _hand_over(self, group: M.RolloutGroup) -> None:
        """Send ``group``; one without a seq (:meth:`_no_signal`) is left out and its admission slot given back."""
        self.generated += 1
        if group.seq >= 0:
            self.client.send_many([group])
        else:
            self.uniform += 1
            self._uniform_by_len = self._uniform_by_len or collections.Counter()
            self._uniform_by_len[funnel.length_bucket(group.length())] += 1
            self.admission.give_back()

    def funnel_metrics(self) -> dict[str, float]:
        """The discard funnel's actor counts; ``in_flight``: handed to the client, not acknowledged yet."""
        return {"funnel/generated": float(self.generated), "funnel/in_flight": float(self.client.outstanding),
                **funnel.lost_metrics({"no_signal": self.uniform}, self._uniform_by_len or {})}

    def _no_signal(self, rewards) -> bool:
        """All rewards equal: the group-normalised advantages are 0 and, without a KL term, the group trains
        nothing (DAPO's dynamic sampling leaves it out) -- up to MAX_UNIFORM_IN_A_ROW in a row."""
        if not (self.cfg.actor.skip_uniform_groups and self.cfg.learner.kl_beta == 0) or len(set(rewards)) > 1:
            self._uniform_streak = 0
            return False
        self._uniform_streak += 1
        if self._uniform_streak == MAX_UNIFORM_IN_A_ROW + 1:
            log.warning("%d groups in a row had equal rewards: sending them until one does not (is the task "
                        "out of the model's reach, or mastered?)", MAX_UNIFORM_IN_A_ROW)
        return self._uniform_streak <= MAX_UNIFORM_IN_A_ROW

    def generate_groups(self, n: int):
        """Yield ``n`` RolloutGroups in completion order, each as soon as its last sample finishes."""
        start_version = self.engine.version
        prompts = [self.task.sample(self.rng, "train") for _ in range(n)]
        size = self.cfg.actor.group_size
        limits = self.limits(prompts, start_version)
        done: dict[int, list] = {}  # prompt -> its samples so far, by position in the group
        for index, sample in self.engine.stream([list(p.tokens) for p in prompts for _ in range(size)],
                                                max_new_tokens=[b for b in limits for _ in range(size)]):
            self._beat()  # a long batch is not a hang
            i, j = divmod(index, size)
            self.curriculum.observe(sample.finish_reason, limits[i])
            done.setdefault(i, [None] * size)[j] = sample
            if None not in done[i]:
                prompt, samples = prompts[i], done.pop(i)
                rewards = self.task.rewards([(prompt, s.tokens) for s in samples])
                seq = -1 if self._no_signal(rewards) else self.client.next_seq()  # -1: not to be sent
                yield M.group_from_samples(
                    samples, rewards, actor_id=self.actor_id, seq=seq,
                    group_id=f"{self.actor_id}-{prompt.id}", task=self.task.name, tier=prompt.tier,
                    prompt=prompt.tokens, start_version=start_version, created_at=time.time())

    def limits(self, prompts, version: int) -> list[int]:
        cur = self.curriculum.limit(version)
        return [prompt_limit(self.cfg, p, cur) for p in prompts]

    def _emit(self, groups, gen_s: float, waited: float) -> None:
        done, v = [c for g in groups for c in g.completions], self.engine.version
        lengths = [c.num_tokens for c in done]
        by_tier: dict[str, list] = {}
        for g in groups:
            by_tier.setdefault(g.tier, []).extend(g.completions)
        self.metrics.emit(v, {
            "actor/tokens_per_s": sum(lengths) / max(gen_s, 1e-9),
            "actor/groups_per_s": len(groups) / max(gen_s + waited, 1e-9),
            "actor/admission_wait_s": waited,
            "actor/uniform_groups": float(self.uniform),  # left out for equal rewards, so far
            "actor/uniform_frac": float(np.mean([g.seq < 0 for g in groups])),
            "actor/buffer_wait_s": float(self.client.admission_wait_s),
            "actor/version": float(v),
            "reward/mean": float(np.mean([c.reward for c in done])),
            "length/mean": float(np.mean(lengths)),
            "length/p90": float(np.percentile(lengths, 90)),
            "length/max": float(max(lengths)),
            "length/limit": float(self.curriculum.limit(v)),
            "length/clip_rate": float(np.mean([c.finish_reason == "length" for c in done])),
            **{f"reward/by_tier/{t}": float(np.mean([c.reward for c in cs])) for t, cs in by_tier.items()},
            **{f"length/by_tier/{t}": float(np.mean([c.num_tokens for c in cs])) for t, cs in by_tier.items()},
            **{k: float(x) for k, x in self.engine.weights.metrics().items()},
            **self.task.metrics(),
            **self.funnel_metrics(),
        })

    def _maybe_eval(self) -> None:
        v = self.engine.version
        if not self.eval_set or (self.last_eval >= 0 and v < self.last_eval + self.cfg.run.eval_every):
            return
        self.last_eval = v
        # sampled as training samples now: the same tier limits and curriculum limit
        reward, length = evaluate(self.engine, self.task, self.eval_set, self.limits(self.eval_set, v))
        self.metrics.emit(v, {"eval/reward": reward, "eval/length": length, "eval/version": float(v)})


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
    log.info("actor %d started at version %d", args.index, worker.engine.version)
    try:
        worker.run()
    except BufferStopped:  # SIGTERM while waiting for the buffer; unsent groups stay in the spool
        log.info("actor %d stopped while waiting for the buffer", args.index)
    except EngineStopped:  # SIGTERM mid-batch: finished groups were sent, the rest never started
        log.info("actor %d stopped mid-generation", args.index)
    finally:
        worker.client.settle(SETTLE_S)  # the buffer is still up: the last acks make the funnel's books close
        worker.metrics.emit(worker.engine.version, worker.funnel_metrics())
        worker.client.close()
        worker.engine.close()
        worker.task.close()
        worker.metrics.close()
        log.info("actor %d stopped", args.index)


if __name__ == "__main__":
    main()
