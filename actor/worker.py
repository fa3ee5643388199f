"""Rollout worker: sample G completions per prompt, score them, stream RolloutGroups to the buffer (its loop:
ARCHITECTURE.md, Dataflow); actor 0 also runs the held-out eval every ``run.eval_every`` versions.
"""

from __future__ import annotations

import argparse
import collections
import logging
import pathlib
import random
import threading
import time

import msgspec
import numpy as np
import torch

from actor import episodes, partial
from actor.curriculum import LengthCurriculum, prompt_limit, state_path
from actor.engines import EngineStopped, Sample, engine_class, make_engine
from actor.evaluate import evaluate
from actor.tasks import Prompt, make_task
from buffer.client import ActorClient, Stopped as BufferStopped
from core import config as C
from core import funnel, heartbeat, placement
from core import messages as M
from core.admission import Admission
from core.metrics import MetricsWriter
from core.proc import die_with_parent, memory_mb, setup_logging, stop_event
from model.tokenizer import Tokenizer
from weightsync import check_devices
from weightsync.base import Stopped

log = logging.getLogger("driftrl.actor")
# groups in a row whose rewards were all equal, left out (skip_uniform_groups); past it they are sent
# anyway: a task out of the model's reach (or mastered) must not leave the learner waiting forever
MAX_UNIFORM_IN_A_ROW = 64
SETTLE_S = 2.0  # at exit, how long the acks of the groups in flight are awaited (the launcher stops actors first)


class _Batch:
    """The groups being generated: their prompts, limits, samples so far, and the seqs of those handed over."""

    def __init__(self, start_version: int, prompts: list[Prompt], limits: list[int], size: int):
        self.start_version, self.prompts, self.limits = start_version, prompts, limits
        self.done: list[list[Sample | None]] = [[None] * size for _ in prompts]
        self.seqs: dict[int, int] = {}  # group -> the seq it was handed over with (-1: left out, no signal)
        self.saved = False  # whether the partial file lists this batch

    @classmethod
    def resumed(cls, saved: partial.SavedBatch, groups: list[partial.SavedGroup]) -> "_Batch":
        prompts = [Prompt(g.prompt_id, tuple(g.prompt), g.tier, g.difficulty, g.answer) for g in groups]
        b = cls(saved.start_version, prompts, [g.limit for g in groups], len(groups[0].samples))
        b.done = [[None if s is None else s.copy() for s in g.samples] for g in groups]
        b.seqs, b.saved = {i: g.seq for i, g in enumerate(groups) if g.seq >= 0}, True  # the file lists it
        return b

    def saved_form(self, actor_id: str, running: dict[tuple[int, int], Sample]) -> partial.SavedBatch:
        """What to save: a finished sample whole, a running one's prefix (``running``, by (group, sample))."""
        groups = []
        for i, (p, done) in enumerate(zip(self.prompts, self.done)):
            seq = self.seqs.get(i)
            if seq == -1:  # left out (no signal): nothing to continue or send
                continue
            samples = [s if s is not None and s.finish_reason else running.get((i, j), s)
                       for j, s in enumerate(done)]
            groups.append(partial.SavedGroup(p.id, list(p.tokens), p.tier, p.difficulty, p.answer, self.limits[i],
                                             samples, -1 if seq is None else seq))
        return partial.SavedBatch(actor_id, self.start_version, groups)


class RolloutWorker:
    uniform = 0  # groups left out for equal rewards (skip_uniform_groups), this incarnation
    generated = 0  # groups finished by the engine, this incarnation (the funnel's top: core/funnel.py)
    _uniform_streak = 0
    _lost_by_len: collections.Counter | None = None  # groups left out or dropped at a restart, by length
    dropped_at_restart = 0  # saved groups too stale to continue (actor/partial.py): generated, then lost
    _batch: _Batch | None = None  # the batch in generation
    _saved_at = 0.0
    _where: list[tuple[int, int]] = []  # the stream's prompt index -> (group, sample)
    restart: dict[str, int] = {}  # what a resume continued and dropped (actor/partial.py), once resumed

    def __init__(self, cfg: C.Config, run_dir: str, index: int, stop: threading.Event | None = None):
        self.cfg, self.run_dir, self.index, self.actor_id = cfg, run_dir, index, f"actor{index}"
        self.stop = stop or threading.Event()  # set by SIGTERM (core.proc.stop_event)
        self.task = make_task(cfg.task, Tokenizer.from_dir(cfg.model.path))
        self.device = placement.actor_device(cfg, index)  # validated as run.py does: started by hand, it fails alike
        check_devices(cfg)  # the transport's device rules too, as run.py checks them
        a = msgspec.structs.replace(cfg.actor, device=str(self.device))
        weights = engine_class(a.engine).weight_source(cfg, run_dir, self.actor_id, stop=self.stop, device=self.device)
        self.engine = make_engine(a, cfg.model.path, weights, seed=cfg.run.seed * 1000 + index)
        self.engine.stop, self.engine.env = self.stop, episodes.environment(self.task)
        self.engine.on_step = self._on_step
        self.partial_path = partial.path(run_dir, self.actor_id)
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
        self.admission = Admission.resumed(self.cfg.learner.groups_per_step // self.cfg.actor.num_actors,
                                           self.cfg.buffer.max_staleness, self.engine.version, self.client.outstanding)
        self.rng = random.Random(hash((self.cfg.run.seed, self.index, self.engine.version)) & 0xFFFFFFFF)
        return True

    def _beat(self) -> None:  # core/heartbeat.py: a role silent for too long is hung
        heartbeat.beat(self.run_dir, self.actor_id)

    def _on_step(self) -> None:
        self._beat()
        every = self.cfg.actor.partial_save_s
        if every and self._batch is not None and time.monotonic() - self._saved_at >= every:
            self.save_partial()

    def save_partial(self) -> None:
        b, progress = self._batch, self.engine.progress()
        running = {self._where[k]: s for k, s in progress.items() if k < len(self._where)}
        partial.save(self.partial_path, b.saved_form(self.actor_id, running))
        b.saved, self._saved_at = True, time.monotonic()

    def _resume(self) -> _Batch | None:
        """The batch an earlier incarnation saved, without its groups already too stale (dropped, counted) and
        those the client still holds; groups it had handed over are sent again under their seqs."""
        saved = partial.load(self.partial_path, self.actor_id, self.cfg.actor.group_size)
        if saved is None:
            return None
        kept, dropped = partial.split(saved, self.engine.version, self.cfg.buffer.max_staleness)
        handed, kept = [g for g in kept if g.seq >= 0], [g for g in kept if g.seq < 0]
        self.generated, self.dropped_at_restart = self.generated + len(dropped), len(dropped)
        self._lost_by_len = self._lost_by_len or collections.Counter()
        self._lost_by_len.update(funnel.length_bucket(max((len(s.tokens) for s in g.samples if s), default=0))
                                 for g in dropped)
        r = self.restart = {"actor/restart_dropped_groups": len(dropped), "actor/restart_dropped_tokens":
                            partial.tokens(dropped), "actor/resumed_groups": len(kept), "actor/resumed_tokens":
                            partial.tokens(kept)}
        log.info("resuming %d groups of a batch started at version %d (%d saved tokens); %d dropped as stale "
                 "(%d tokens), %d handed over before", len(kept), saved.start_version, r["actor/resumed_tokens"],
                 len(dropped), r["actor/restart_dropped_tokens"], len(handed))
        if handed:
            b = _Batch.resumed(saved, handed)
            self.admission.start(self.client.resend([self._group(b, i, seq) for i, seq in b.seqs.items()]))
        if not kept:
            partial.clear(self.partial_path)
            return None
        return _Batch.resumed(saved, kept)

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
        if (resumed := self._resume()) is not None:
            self.admission.start(len(resumed.prompts))  # admitted before the restart: they count again
            self._generate(resumed, 0.0)
        while not self.stop.is_set():
            self._maybe_eval()
            n, waited = self._wait_for_admission()
            if n == 0:
                break
            self.admission.start(n)
            self._generate(self.new_batch(n), waited)
        self.client.flush(timeout_s=5.0)

    def new_batch(self, n: int) -> _Batch:
        prompts, v = [self.task.sample(self.rng, "train") for _ in range(n)], self.engine.version
        return _Batch(v, prompts, self.limits(prompts, v), self.cfg.actor.group_size)

    def _generate(self, batch: _Batch, waited: float) -> None:
        self.client.in_flight(batch.start_version)  # buffer.stale_strategy = wait holds the learner for these
        t0, sending, groups = time.time(), 0.0, []
        try:
            for group in self.generate_groups(batch):  # each sent as soon as its last sample is done
                groups.append(group)
                t_send = time.time()
                self._hand_over(group)  # may wait for the buffer's window: not generation
                sending += time.time() - t_send
        except (EngineStopped, BufferStopped):  # a graceful stop: the next incarnation continues the batch
            if self.cfg.actor.partial_save_s and self._batch is not None:
                self.save_partial()
            raise
        self._batch = None
        if batch.saved:
            partial.clear(self.partial_path)
        self.client.in_flight(-1)
        self._emit(batch, groups, time.time() - t0 - sending, waited)

    def _hand_over(self, group: M.RolloutGroup) -> None:
        """Send ``group``; one without a seq (:meth:`_no_signal`) is left out and its admission slot given back."""
        self.generated += 1
        if group.seq >= 0:
            self.client.send_many([group])
        else:
            self.uniform += 1
            self._lost_by_len = self._lost_by_len or collections.Counter()
            self._lost_by_len[funnel.length_bucket(group.length())] += 1
            self.admission.give_back()

    def funnel_metrics(self) -> dict[str, float]:
        """The discard funnel's actor counts; ``in_flight``: handed to the client, not acknowledged yet."""
        return {"funnel/generated": float(self.generated), "funnel/in_flight": float(self.client.outstanding),
                **funnel.lost_metrics({"no_signal": self.uniform, "restart": self.dropped_at_restart},
                                      self._lost_by_len or {})}

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

    def generate_groups(self, batch: _Batch):
        """Yield the batch's RolloutGroups in completion order, each as soon as its last sample finishes
        (a resumed batch's unfinished samples continue from their prefixes)."""
        self._batch, fin = batch, lambda s: s is not None and s.finish_reason
        for i, done in enumerate(batch.done):  # resumed with every sample finished
            if all(map(fin, done)):
                yield self._finish(batch, i)
        self._where = [(i, j) for i, done in enumerate(batch.done) for j, s in enumerate(done) if not fin(s)]
        for index, sample in self.engine.stream([list(batch.prompts[i].tokens) for i, _ in self._where],
                                                max_new_tokens=[batch.limits[i] for i, _ in self._where],
                                                prefixes=[batch.done[i][j] for i, j in self._where]):
            self._beat()  # a long batch is not a hang
            i, j = self._where[index]
            self.curriculum.observe(sample.finish_reason, batch.limits[i])
            batch.done[i][j] = sample
            if all(map(fin, batch.done[i])):
                yield self._finish(batch, i)

    def _finish(self, batch: _Batch, i: int) -> M.RolloutGroup:
        """Score group ``i``; its seq goes into the partial file (when that lists the batch) before the
        group reaches the client, so a restart in between sends it again under the same seq."""
        rewards = self.task.rewards([(batch.prompts[i], s.tokens) for s in batch.done[i]])
        seq = batch.seqs[i] = -1 if self._no_signal(rewards) else self.client.next_seq()  # -1: not to be sent
        if batch.saved:
            self.save_partial()
        return self._group(batch, i, seq, rewards)

    def _group(self, batch: _Batch, i: int, seq: int, rewards=None) -> M.RolloutGroup:
        prompt, samples = batch.prompts[i], batch.done[i]
        rewards = rewards if rewards is not None else self.task.rewards([(prompt, s.tokens) for s in samples])
        return M.group_from_samples(samples, rewards, actor_id=self.actor_id, seq=seq, task=self.task.name,
                                    group_id=f"{self.actor_id}-{prompt.id}", tier=prompt.tier, prompt=prompt.tokens,
                                    start_version=batch.start_version, created_at=time.time())

    def limits(self, prompts, version: int) -> list[int]:
        return [prompt_limit(self.cfg, p, self.curriculum.limit(version)) for p in prompts]

    def _emit(self, batch: _Batch, groups, gen_s: float, waited: float) -> None:
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
            **{f"actor/{k}": mb for k, mb in memory_mb().items()},
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
            **(self._episode_metrics(batch, groups) if self.engine.env is not None and groups else {}),
            **self.funnel_metrics(),
            **{k: float(v) for k, v in self.restart.items()},
        })

    def _episode_metrics(self, batch: _Batch, groups) -> dict[str, float]:
        items = [(p, s.tokens) for p, done in zip(batch.prompts, batch.done) for s in done if s is not None]
        return {**episodes.episode_metrics([c for g in groups for c in g.completions]), **self.engine.env.metrics(),
                **self.task.episode_metrics(items)}

    def _maybe_eval(self) -> None:
        v = self.engine.version
        if not self.eval_set or (self.last_eval >= 0 and v < self.last_eval + self.cfg.run.eval_every):
            return
        self.last_eval = v
        extra: dict = {}  # sampled as training samples now: the same tier limits and curriculum limit
        reward, length = evaluate(self.engine, self.task, self.eval_set, self.limits(self.eval_set, v), extra)
        self.metrics.emit(v, {"eval/reward": reward, "eval/length": length, "eval/version": float(v), **extra})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--index", type=int, default=0)
    args = ap.parse_args(argv)
    die_with_parent()
    log = setup_logging(f"actor{args.index}")
    stop = stop_event()
    cfg = C.from_json(pathlib.Path(args.run_dir, "config.json").read_bytes())
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
        for part in (worker.client, worker.engine, worker.task, worker.metrics):
            part.close()
        log.info("actor %d stopped", args.index)


if __name__ == "__main__":
    main()
