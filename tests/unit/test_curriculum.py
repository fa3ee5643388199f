"""Response-length limits: the curriculum's schedules, a prompt's limit, the worker's wiring (each
prompt's limit reaches the engine; the length metrics per tier), and evaluation under tier limits.

The worker is built piecemeal as in test_worker_admission.py: a real tiny engine and the real
arith task, whose prompts get tiers by id here (arith prompts are all "default"); a row never
stops at EOS, so every completion's length is exactly the limit it ran under."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil

import msgspec
import pytest
import torch

from actor.curriculum import LengthCurriculum, prompt_limit, state_path
from actor.engines import sglang as S
from actor.evaluate import evaluate, final_eval, task_report
from actor.tasks import Prompt
from actor.worker import RolloutWorker
from core import config as C
from model.sampling import SamplingSpec
from tests.support.tiny import make_group, tiny_cfg, tiny_engine, tiny_model_dir, tiny_task

torch.set_num_threads(1)
TIERS = ("low", "medium", "high")


def _actor(schedule: str, *extra: str, cap: int = 16):
    return tiny_cfg(f"actor.max_new_tokens={cap}", f"actor.length_schedule={schedule}", "actor.length_start=8",
                    "actor.length_grow=4", "actor.length_every=10", "actor.length_clip_rate=0.2",
                    "actor.length_window=10", *extra, resolved=False).actor


# ---- schedules


def test_steps_grow_every_n_versions_up_to_the_cap():
    c = LengthCurriculum(_actor("steps"))
    got = [c.limit(v) for v in (-1, 0, 9, 10, 19, 20, 29, 30, 1000)]
    assert got == [8, 8, 8, 12, 12, 16, 16, 16, 16]
    assert LengthCurriculum(_actor("steps", cap=14)).limit(25) == 14
    assert not c.observe("length", 8) and c.limit(0) == 8  # pure in the version: nothing to feed


def test_off_is_the_cap_throughout():
    c = LengthCurriculum(_actor("off"))
    for _ in range(20):
        c.observe("length", 16)
    assert [c.limit(v) for v in (0, 100)] == [16, 16]


def test_clip_rate_grows_above_the_threshold_only_then_restarts_its_window(tmp_path):
    c = LengthCurriculum(_actor("clip_rate"), str(tmp_path / "c.json"))
    feed = ["stop", "length", "length"] + ["stop"] * 7  # 2 of 10 cut: not more than 20 %
    assert not any(c.observe(f, 8) for f in feed) and c.limit(0) == 8
    assert c.observe("length", 8)  # pushes out a "stop": 3 of the last 10 cut
    assert c.limit(0) == 12 and len(c.window) == 0
    assert not c.observe("length", 8) and len(c.window) == 0  # ran under the old limit: not counted
    assert not any(c.observe("length", 12) for _ in range(9))  # a window not yet full decides nothing
    assert c.observe("length", 12) and c.limit(0) == 16
    assert not c.observe("length", 16) and c.limit(0) == 16  # at the cap


def test_clip_rate_limit_survives_a_restart(tmp_path):
    path = state_path(str(tmp_path), "actor1")
    c = LengthCurriculum(_actor("clip_rate"), path)
    assert not (tmp_path / "curriculum").exists()  # written on a change only
    for _ in range(10):
        c.observe("length", 8)
    assert json.loads(open(path).read()) == {"limit": 12}
    assert LengthCurriculum(_actor("clip_rate"), path).limit(0) == 12  # the restarted actor
    assert LengthCurriculum(_actor("clip_rate", cap=10), path).limit(0) == 10  # a resume that lowered the cap
    assert LengthCurriculum(_actor("steps"), path).limit(0) == 8  # steps is pure: the file is not read
    open(path, "w").write('{"limit": 0}')
    with pytest.raises(ValueError, match="`limit` = 0"):
        LengthCurriculum(_actor("clip_rate"), path)


def test_prompt_limit_is_the_smallest_of_cap_tier_and_curriculum():
    cfg = tiny_cfg("actor.max_new_tokens=6", "task.tier_max_new_tokens.low=2", "task.tier_max_new_tokens.high=5",
                   resolved=False)
    tiers = ("low", "medium", "high", "default")
    assert [prompt_limit(cfg, Prompt("p", (1,), t)) for t in tiers] == [2, 6, 5, 6]
    assert [prompt_limit(cfg, Prompt("p", (1,), t), 3) for t in tiers] == [2, 3, 3, 3]
    assert [prompt_limit(cfg, Prompt("p", (1,), t), 9) for t in tiers] == [2, 6, 5, 6]


# ---- the worker's wiring


class _TieredArith:
    """The real arith task; each prompt's tier picked from its id (arith's are all "default")."""

    def __init__(self, task):
        self.task = task

    def sample(self, rng, split="train"):
        p = self.task.sample(rng, split)
        return dataclasses.replace(p, tier=TIERS[sum(map(ord, p.id)) % 3])

    def __getattr__(self, name):
        return getattr(self.task, name)


def _worker(*extra: str) -> RolloutWorker:
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = tiny_cfg("actor.group_size=2", "actor.max_new_tokens=6", "task.tier_max_new_tokens.low=2",
                     "task.tier_max_new_tokens.high=4", *extra)
    w.engine = tiny_engine(temperature=2.0, seed=5)
    w.engine.eos_ids = torch.tensor([-1])  # no row stops at EOS: each runs to its limit
    w.client, w.task, w.rng, w.actor_id = _Seqs(), _TieredArith(tiny_task()), random.Random(0), "actor0"
    w.run_dir, w.curriculum = "", LengthCurriculum(w.cfg.actor)
    return w


class _Seqs:
    n, admission_wait_s, outstanding = 0, 0.0, 0

    def next_seq(self):
        self.n += 1
        return self.n


def _lengths_by_tier(groups) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for g in groups:
        out.setdefault(g.tier, set()).update(c.num_tokens for c in g.completions)
    return out


def test_worker_gives_each_prompt_its_tier_and_curriculum_limit(tmp_path):
    w = _worker()
    w.curriculum = LengthCurriculum(w.cfg.actor)  # "off": tier limits and the cap
    groups = list(w.generate_groups(w.new_batch(9)))
    assert _lengths_by_tier(groups) == {"low": {2}, "medium": {6}, "high": {4}}
    steps = ["actor.length_schedule=steps", "actor.length_start=3", "actor.length_grow=2", "actor.length_every=2"]
    w = _worker(*steps)
    w.curriculum = LengthCurriculum(w.cfg.actor)
    assert _lengths_by_tier(w.generate_groups(w.new_batch(9))) == {"low": {2}, "medium": {3}, "high": {3}}  # version 0: 3
    w.engine.version = 2  # the batch's start version: 3 + 2 = 5
    assert _lengths_by_tier(w.generate_groups(w.new_batch(9))) == {"low": {2}, "medium": {5}, "high": {4}}


def test_worker_feeds_clip_rate_and_persists_its_growth(tmp_path):
    w = _worker("actor.length_schedule=clip_rate", "actor.length_start=3", "actor.length_grow=2",
                "actor.length_window=4")
    w.curriculum = LengthCurriculum(w.cfg.actor, state_path(str(tmp_path), "actor0"))
    groups = list(w.generate_groups(w.new_batch(9)))  # all cut: the 4th under 3 (tier "low" runs under 2) grows it
    assert w.curriculum.limit(0) == 5  # once: the rest ran under 3 too, no longer the current limit
    assert json.loads(open(state_path(str(tmp_path), "actor0")).read()) == {"limit": w.curriculum.limit(0)}
    assert {c.num_tokens for g in groups if g.tier != "low" for c in g.completions} == {3}  # fixed per batch


class _Sink:
    def __init__(self):
        self.records = []

    def emit(self, step, values):
        self.records.append((step, values))


class _Weights:
    def metrics(self):
        return {}


def test_worker_emits_length_limit_clip_rate_and_length_by_tier():
    w = _worker("actor.length_schedule=steps", "actor.length_start=3", "actor.length_grow=2", "actor.length_every=2")
    w.curriculum, w.metrics, w.engine.weights = LengthCurriculum(w.cfg.actor), _Sink(), _Weights()
    w.engine.version = 2
    low = make_group([1, 2], [([5, 6], [-1.0] * 2, [2] * 2, "length", 1.0), ([5, 2], [-1.0] * 2, [2] * 2, "stop", 0.0)])
    high = make_group([1, 3], [([5] * 5, [-1.0] * 5, [2] * 5, "length", 0.0), ([2], [-1.0], [2], "stop", 1.0)], seq=1)
    w._emit(None, [msgspec.structs.replace(low, tier="low"), msgspec.structs.replace(high, tier="high")], 1.0, 0.0)
    step, m = w.metrics.records[-1]
    assert step == 2 and m["length/limit"] == 5.0  # 3 + 2 * (2 // 2), under the cap 6
    assert m["length/clip_rate"] == pytest.approx(0.5)
    assert m["length/by_tier/low"] == pytest.approx(2.0) and m["length/by_tier/high"] == pytest.approx(3.0)
    assert m["reward/by_tier/low"] == pytest.approx(0.5) and m["reward/by_tier/high"] == pytest.approx(0.5)


# ---- the SGLang engine: one request per prompt, each with its own limit


class _Recorder:
    """Answers every /generate with its own max_new_tokens of token 7, cut by the limit."""

    def __init__(self):
        self.bodies = []

    def start(self, timeout_s, stop=None):
        """Nothing to start: this recorder answers in-process."""

    def post(self, path, body, timeout_s=None):
        self.bodies.append(body)
        n = body["sampling_params"]["max_new_tokens"]
        return {"output_ids": [7] * n, "meta_info": {"finish_reason": {"type": "length", "length": n},
                                                     "output_token_logprobs": [[-0.5, 7, None]] * n}}


def test_sglang_sends_each_prompt_its_own_max_new_tokens():
    server = _Recorder()
    engine = S.SGLangEngine(server, SamplingSpec(), eos_ids=[2], max_new_tokens=4, max_batch=2)
    samples = engine.generate([[1, 3], [1, 4], [1, 5]], max_new_tokens=[2, 5, 2])
    assert [len(s.tokens) for s in samples] == [2, 5, 2]
    sent = {tuple(b["input_ids"]): b["sampling_params"]["max_new_tokens"] for b in server.bodies}
    assert sent == {(1, 3): 2, (1, 4): 5, (1, 5): 2}
    assert engine.generate([[1, 3]])[0].tokens == [7] * 4  # none: the engine's own
    with pytest.raises(ValueError, match="1 limits for 2 prompts"):
        engine.generate([[1, 3], [1, 4]], max_new_tokens=[3])


# ---- evaluation honours tier limits


def test_eval_samples_under_each_prompts_tier_limit(tmp_path):
    """arith prompts are tier "default": its limit of 1 makes every sample one token (EOS or
    cut), where the cap of 6 would let most run longer."""
    cfg = tiny_cfg("actor.max_new_tokens=6", "task.tier_max_new_tokens.default=1", "run.eval_prompts=6",
                   "actor.dtype=float32")
    report = task_report(cfg, tiny_model_dir(), 2, lambda *a: contextlib.nullcontext(lambda n: None))
    assert report["mean_length"] == 1.0 and report["prompts"] == 6
    shutil.copytree(tiny_model_dir(), tmp_path / "final_model")
    (tmp_path / "config.json").write_bytes(C.to_json(cfg))
    assert final_eval(str(tmp_path))["eval/length"] == 1.0
    engine, task = _no_eos_engine(), tiny_task()
    prompts = task.eval_set(3)
    assert evaluate(engine, task, prompts, [2, 5, 3])[1] == pytest.approx(10 / 3)  # the in-run eval's limits


def _no_eos_engine():
    engine = tiny_engine(temperature=2.0, seed=1)
    engine.eos_ids = torch.tensor([-1])
    return engine
