"""Self-distillation corpus (actor/distill.py): shortest-correct selection, and the corpus the
tiny arith policy really produces, checked against the samples its engine returned."""

from __future__ import annotations

import json

import numpy as np
import pytest

import actor.distill as D
from actor.engines import Sample
from actor.tasks import Prompt, make_task
from model.tokenizer import Tokenizer
from tests.support.tiny import tiny_cfg, tiny_model_dir


def _s(n: int, finish: str = "stop") -> Sample:
    return Sample(list(range(n)), [0.0] * n, [0] * n, finish)


def test_shortest_correct_picks_the_shortest_correct_among_mixed():
    samples = [_s(5), _s(3), _s(4), _s(6)]
    assert D.shortest_correct(samples, [1.0, 1.0, 1.0, 0.0]) == 1
    assert D.shortest_correct(samples, [1.0, 0.0, 1.0, 1.0]) == 2


def test_shortest_correct_ignores_shorter_wrong_and_truncated_scoring_samples():
    samples = [_s(5), _s(2), _s(3, "length"), _s(4)]
    # the length-2 sample is wrong, the length-3 one scores but never stopped
    assert D.shortest_correct(samples, [1.0, 0.0, 1.0, 1.0]) == 3
    assert D.shortest_correct(samples, [0.0, 0.4, 1.0, 0.0]) is None  # 0.4 is not > 0.5


def test_shortest_correct_ties_go_to_the_first_and_none_correct_is_none():
    assert D.shortest_correct([_s(4), _s(3), _s(3), _s(3)], [1.0, 0.0, 1.0, 1.0]) == 2
    assert D.shortest_correct([_s(2), _s(3)], [0.0, 0.0]) is None
    assert D.shortest_correct([], []) is None
    with pytest.raises(ValueError, match="zip"):
        D.shortest_correct([_s(2)], [1.0, 1.0])


def test_accept_rewrites_takes_only_correct_strictly_shorter_ones():
    prompts = [Prompt(str(i), (1,)) for i in range(5)]
    rows = [D._row(p, [7, 7, 7, 2]) for p in prompts]
    rewrites = [_s(2), _s(4), _s(2), _s(2, "length"), _s(6)]
    assert D.accept_rewrites(prompts, rows, rewrites, [1.0, 1.0, 0.0, 1.0, 1.0]) == 1
    assert [r["compressed"] for r in rows] == [True, False, False, False, False]
    assert rows[0]["completion"] == [0, 1] and all(r["completion"] == [7, 7, 7, 2] for r in rows[1:])


def _cfg(*extra: str):
    # 1-digit sums: the tiny model gets some right, so the corpus is not empty
    return tiny_cfg("task.digits=1", "actor.dtype=float32", "distill.prompts=48", "distill.samples=8", *extra)


def test_train_prompts_are_distinct_seeded_and_bounded():
    cfg = _cfg()
    task = make_task(cfg.task, Tokenizer.from_dir(tiny_model_dir()))
    first = D.train_prompts(task, 40, seed=3)
    assert len({p.id for p in first}) == 40
    assert [p.id for p in D.train_prompts(task, 40, seed=3)] == [p.id for p in first]
    with pytest.raises(ValueError, match="distill.prompts=500"):
        D.train_prompts(task, 500, seed=3)  # 1-digit sums have < 100 training prompts


@pytest.fixture
def spied(monkeypatch):
    """The real engine, with every ``generate`` call's prompts and samples recorded."""
    import actor.evaluate as E

    calls = []
    real = E.make_engine

    def make(*args, **kwargs):
        engine = real(*args, **kwargs)
        generate = engine.generate

        def recording(prompts, **kw):
            out = generate(prompts, **kw)
            calls.append((prompts, out))
            return out

        engine.generate = recording
        return engine

    monkeypatch.setattr(E, "make_engine", make)
    return calls


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _by_prompt(calls, k: int) -> dict[tuple, list[Sample]]:
    out = {}
    for prompts, samples in calls:
        for i in range(0, len(prompts), k):
            out[tuple(prompts[i])] = samples[i:i + k]
    return out


def test_build_corpus_keeps_the_shortest_correct_sample_of_each_prompt(tmp_path, spied):
    cfg, seen = _cfg(), []
    task = make_task(cfg.task, Tokenizer.from_dir(tiny_model_dir()))
    stats = D.build_corpus(cfg, tiny_model_dir(), str(tmp_path / "corpus.jsonl"), progress=seen.append)
    rows, k = _rows(tmp_path / "corpus.jsonl"), cfg.distill.samples
    by_prompt = _by_prompt(spied, k)
    prompts = {p.id: p for p in D.train_prompts(task, cfg.distill.prompts, cfg.run.seed)}
    assert len(by_prompt) == cfg.distill.prompts and sum(seen) == cfg.distill.prompts
    assert rows and len({r["id"] for r in rows}) == len(rows) == stats["corpus"]
    for r in rows:
        p = prompts[r["id"]]
        assert r["prompt"] == list(p.tokens) and (r["tier"], r["difficulty"]) == (p.tier, p.difficulty)
        assert task.reward(p, r["completion"]) == 1.0 and r["completion"][-1] in task.tok.eos_ids
        samples = by_prompt[tuple(p.tokens)]
        best = D.shortest_correct(samples, task.rewards([(p, s.tokens) for s in samples]))
        assert r["completion"] == samples[best].tokens
    every = [s for ss in by_prompt.values() for s in ss]
    assert stats["samples"] == len(every) == cfg.distill.prompts * k
    assert stats["mean_length_all"] == pytest.approx(np.mean([len(s.tokens) for s in every]))
    assert stats["mean_length_kept"] == pytest.approx(np.mean([len(r["completion"]) for r in rows]))
    assert stats["mean_length_kept"] == stats["mean_length_selected"] and stats["compress_tried"] == 0
    assert stats["corpus"] / stats["prompts"] >= stats["accuracy_policy"] > 0  # a prompt counts once


def test_compress_pass_replaces_only_with_shorter_correct_rewrites(tmp_path, spied):
    cfg = _cfg("distill.compress_prompt==", "distill.prompts=32")
    task = make_task(cfg.task, Tokenizer.from_dir(tiny_model_dir()))
    stats = D.build_corpus(cfg, tiny_model_dir(), str(tmp_path / "corpus.jsonl"))
    rows, instruction = _rows(tmp_path / "corpus.jsonl"), task.tok.encode("=")
    prompts = {p.id: p for p in D.train_prompts(task, cfg.distill.prompts, cfg.run.seed)}
    # a rewrite's prompt is a training prompt followed by an answer: never a training prompt itself
    plain = {tuple(p.tokens) for p in prompts.values()}
    sampling = [c for c in spied if tuple(c[0][0]) in plain]
    rewrites = {tuple(p): s for c in spied if tuple(c[0][0]) not in plain for p, s in zip(*c)}
    by_prompt = _by_prompt(sampling, cfg.distill.samples)
    assert stats["compress_tried"] == len(rows) == len(rewrites) > 0
    assert stats["compress_accepted"] == sum(r["compressed"] for r in rows)
    for r in rows:
        p = prompts[r["id"]]
        samples = by_prompt[tuple(p.tokens)]
        selected = samples[D.shortest_correct(samples, task.rewards([(p, s.tokens) for s in samples]))].tokens
        rewrite = rewrites[tuple(list(p.tokens) + selected[:-1] + instruction)]
        better = task.reward(p, rewrite.tokens) > 0.5 and rewrite.finish_reason == "stop" \
            and len(rewrite.tokens) < len(selected)
        assert r["compressed"] == better
        assert r["completion"] == (rewrite.tokens if better else selected)
    assert stats["mean_length_kept"] <= stats["mean_length_selected"]
