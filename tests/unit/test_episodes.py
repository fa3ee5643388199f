"""Multi-turn episodes (actor/episodes.py, Engine._episodes): token in and token out, the mask through the
wire, the collate, the loss and the ratio metrics, per-token versions across a weight update between two turns,
a hanging tool killed at its deadline, resume of a paused episode, and the calc task's tool."""

import functools
import random
import time

import msgspec
import numpy as np
import pytest
import torch

from actor import episodes, partial
from actor.engines import Sample
from actor.episodes import FORMATS, Environment, append, turns
from actor.tasks.calc import CalcTask, calculator
from core import messages as M
from learner.batching import collate
from learner.losses import LossInputs
from learner.losses.ring_zero import ring_zero_loss
from learner.ratio_metrics import ratio_metrics
from tests.support.tiny import tiny_cfg, tiny_engine, tiny_model, tiny_tokenizer

torch.set_num_threads(1)
TOK = tiny_tokenizer()
DIGITS = tuple(TOK.encode("0123456789"))
REPLY = TOK.encode("1+")


class Scripted(Environment):
    """Pauses on any digit and answers "1+"; ``on_turn`` runs before each answer (a weight update lands)."""

    pause_ids, max_turns = DIGITS, 3

    def __init__(self, on_turn=None):
        self.on_turn, self.asked = on_turn, 0

    def respond(self, samples):
        self.asked += len(samples)
        if self.on_turn is not None:
            self.on_turn()
        return [list(REPLY) for _ in samples]


def _prompts(n=12, seed=0):
    rng = random.Random(seed)
    return [[TOK.bos_id, *TOK.encode(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=")] for _ in range(n)]


def _logp_ref(model, prompt, tokens):
    """Log-probs of every token of ``tokens`` after ``prompt``: one full forward, no cache (temperature 1)."""
    ids = torch.tensor(prompt + tokens)[None]
    with torch.no_grad():
        h = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
        logp = torch.log_softmax(model.logits(h)[0].double(), -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def test_append_masks_and_cuts_at_the_limit():
    s = Sample([5, 6], [-0.5, -0.25], [3, 4], "tool")
    append(s, [7, 8, 9], limit=4)
    assert (s.tokens, s.mask, s.logprobs, s.versions) == ([5, 6, 7, 8], [1, 1, 0, 0], [-0.5, -0.25, 0.0, 0.0], [3, 4, 4, 4])
    assert s.finish_reason == "length" and turns(s.mask) == 2
    s = Sample([5], [-0.5], [3], "tool")
    append(s, [7], limit=8)
    assert s.finish_reason == "" and turns(s.mask + [1, 0, 1]) == 3 and turns(None) == 1


def test_token_in_token_out_and_the_behaviour_logprobs_after_each_turn():
    """The episode's ids are the sampled ids and the environment's, byte for byte; every sampled token's
    log-prob is the model's given everything before it, environment tokens included (the cache continues right)."""
    model, env = tiny_model(), Scripted()
    engine = tiny_engine(model)
    engine.max_new_tokens, engine.env = 12, env
    prompts = _prompts()
    samples = engine.generate(prompts)
    assert env.asked > 0 and any(turns(s.mask) == 3 for s in samples)
    for prompt, s in zip(prompts, samples):
        assert s.finish_reason in ("stop", "length") and len(s.tokens) == len(s.mask or s.tokens) <= 12
        mask = s.mask or [1] * len(s.tokens)
        runs = [[]]
        for j, (t, m) in enumerate(zip(s.tokens, mask)):
            runs[-1:] = [runs[-1] + [t]] if not m else [runs[-1], []] if runs[-1] else [[]]
        assert all(r == REPLY or (r == REPLY[: len(r)] and len(s.tokens) == 12) for r in runs if r)
        ref = _logp_ref(model, prompt, s.tokens)
        for j, m in enumerate(mask):
            if m:
                assert s.logprobs[j] == pytest.approx(ref[j], abs=2e-4)
            else:
                assert s.logprobs[j] == 0.0 and s.versions[j] == s.versions[j - 1]
        # through the wire and the collate: the trained ids are the episode's, env positions carry no loss
        g = M.group_from_samples([s, s], [1.0, 0.0], actor_id="a", seq=0, group_id="g", task="t", tier="default",
                                 prompt=prompt, start_version=0)
        g = M.group_decoder(M.NO_LIMITS).decode(M.encode(g))
        assert M.validate_group(g) and g.completions[0].tokens == np.asarray(s.tokens, M.TOKEN_DTYPE).tobytes()
        b = collate([g], learner_version=0)
        assert b.ids[0, : len(prompt) + len(s.tokens)].tolist() == prompt + s.tokens
        assert b.mask[0, len(prompt) - 1: len(prompt) - 1 + len(s.tokens)].tolist() == [float(m) for m in mask]
        assert b.num_tokens == 2 * sum(mask)


def _episode_batch():
    s = Sample([4, 5, 6, 7, 8], [-1.0, -2.0, 0.0, 0.0, -1.5], [0, 0, 0, 0, 1], "stop", [1, 1, 0, 0, 1])
    g = M.group_from_samples([s, s], [1.0, 0.0], actor_id="a", seq=0, group_id="g", task="t", tier="default",
                             prompt=[1, 2, 3], start_version=0)
    return collate([g], learner_version=1)


def test_environment_tokens_carry_no_loss_and_no_ratio():
    b = _episode_batch()
    env = b.mask == 0
    logp = b.behaviour_logp.clone()
    logp[env] += 30.0  # a learner that would put a ratio of e^30 on every environment token
    assert ratio_metrics(logp, b.behaviour_logp, b.mask)["ratio/max"] == pytest.approx(1.0)
    logp.requires_grad_(True)
    loss, _ = ring_zero_loss(LossInputs(logp, b.behaviour_logp, torch.tensor([1.0, -1.0]), b.mask))
    loss.backward()
    assert (logp.grad[env] == 0).all() and (logp.grad[b.mask > 0] != 0).all()
    assert b.num_tokens == 2 * 3


@pytest.mark.parametrize("mask, logprob, why", [([1, 1, 0], 0.0, "length"), ([1, 2, 1, 0], 0.0, "a flag of 2"),
                                                ([0, 1, 1, 1], 0.0, "an episode opens with a sampled token"),
                                                ([1, 1, 0, 1], -0.5, "an environment token has a log-prob")])
def test_validation_refuses_a_bad_mask(mask, logprob, why):
    c = M.make_completion([4, 5, 6, 7], [-1.0, -1.0, logprob, -1.0], [0] * 4, "stop", 1.0, mask)
    good = M.make_completion([4, 5, 6, 7], [-1.0, -1.0, 0.0, -1.0], [0] * 4, "stop", 1.0, [1, 1, 0, 1])
    g = M.RolloutGroup("a", 0, "g", "t", "d", np.asarray([1, 2], M.TOKEN_DTYPE).tobytes(), [good, c], 0, 0.0)
    with pytest.raises(M.InvalidMessage) as e:
        M.validate_group(g)
    assert e.value.reason == "bad_mask", why
    assert M.validate_group(msgspec.structs.replace(g, completions=[good, good]))


def test_a_weight_update_between_two_turns_versions_each_token():
    """Tokens sampled before the environment's turn keep version 0, the environment's carry the token before
    them, the next turn's are sampled (and prefilled) under version 1."""
    class Source:
        version, pending = 0, False

        def apply(self, params):
            if self.pending:
                self.pending, self.version = False, 1
                return 1
            return 0 if self.version == 0 else None

    src = Source()
    env = Scripted(on_turn=lambda: setattr(src, "pending", True))
    engine = tiny_engine()
    engine.max_new_tokens, engine.env, engine.weights, engine.version = 12, env, src, -1
    samples = engine.generate(_prompts(seed=1))
    multi = [s for s in samples if s.mask and 0 in s.mask and s.mask[-1] == 1]
    assert multi
    for s in multi:
        first_env = s.mask.index(0)
        assert set(s.versions[:first_env]) == {0} and s.versions[first_env] == 0
        assert set(v for v, m in zip(s.versions[first_env:], s.mask[first_env:]) if m) == {1}


@functools.lru_cache(maxsize=None)
def _calc_tokenizer():
    from model.tokenizer import Tokenizer

    return Tokenizer.from_dir(CalcTask.base_model(tiny_cfg("task.name=calc", "task.digits=3", resolved=False)))


def _calc_env(tool: str, timeout_s: float = 0.5):
    cfg = tiny_cfg("task.name=calc", f"task.tools.tool={tool!r}".replace("'", '"'), f"task.tools.timeout_s={timeout_s}")
    return episodes.environment(CalcTask(cfg.task, _calc_tokenizer()))


def _paused(text: str) -> Sample:
    ids = _calc_tokenizer().encode(text)
    return Sample(ids, [-1.0] * len(ids), [0] * len(ids), "tool")


def test_a_hanging_tool_is_killed_at_its_deadline_and_answers_an_error():
    env = _calc_env("tests.support.tools:slow_calc", timeout_s=0.5)
    tok = _calc_tokenizer()
    try:
        ok, hung, bad = _paused("[12+30]"), _paused("[9+1]"), _paused("12]")
        t0 = time.monotonic()
        env.answer([(ok, 32), (hung, 32), (bad, 32)])
        assert time.monotonic() - t0 < 10
        assert tok.decode(ok.tokens) == "[12+30]=42\n" and tok.decode(hung.tokens) == "[9+1]=error\n"
        assert tok.decode(bad.tokens) == "12]=error\n" and ok.mask == [1] * 7 + [0] * 4
        m = env.metrics()
        assert (m["tool/ok"], m["tool/timeouts"], m["tool/malformed"]) == (1.0, 1.0, 1.0)
        again = _paused("[2+2]")
        env.answer([(again, 32)])
        assert tok.decode(again.tokens) == "[2+2]=4\n"  # a replacement worker serves the next call
    finally:
        env.close()


def test_max_turns_ends_the_episode():
    env = _calc_env("actor.tasks.calc:calculator")
    try:
        s = _paused("[1+1]")
        s.mask = [1] * len(s.tokens)
        for _ in range(env.max_turns - 1):
            env.answer([(s, 64)])
            append(s, _calc_tokenizer().encode("[1+1]"), 64)
            s.mask[-5:], s.logprobs[-5:] = [1] * 5, [-1.0] * 5
        env.answer([(s, 64)])
        assert s.finish_reason == "length" and turns(s.mask) == env.max_turns
    finally:
        env.close()


def test_a_paused_episode_resumes_from_its_saved_prefix(tmp_path):
    """A prefix saved while the tool's answer was pending (its last token the pause id) gets the answer first,
    then continues; the saved tokens, mask and versions start the result unchanged."""
    engine = tiny_engine()
    engine.max_new_tokens, engine.env = 12, Scripted()
    prefix = Sample([DIGITS[3]], [-0.7], [0], "", [1])
    batch = partial.SavedBatch("a", 0, [partial.SavedGroup("p", [1, 2], "default", 0.0, "", 12, [
        partial.Sample(prefix.tokens, prefix.logprobs, prefix.versions, "", prefix.mask), None])])
    partial.save(str(tmp_path / "p"), batch)
    saved = partial.load(str(tmp_path / "p"), "a", 2).groups[0].samples[0]
    assert saved.mask == [1]
    got = engine.generate([_prompts(1)[0]], prefixes=[Sample(saved.tokens, saved.logprobs, saved.versions, "",
                                                              saved.mask)])[0]
    assert got.tokens[:3] == [DIGITS[3], *REPLY] and got.mask[:3] == [1, 0, 0] and got.logprobs[0] == -0.7


def test_progress_holds_the_episodes_between_two_turns():
    """What the worker saves mid-batch: a paused episode is there, with its tokens so far."""
    seen = []
    engine = tiny_engine()
    engine.max_new_tokens = 12
    engine.env = Scripted(on_turn=lambda: seen.append(engine.progress()))
    engine.generate(_prompts(4))
    assert seen and all(s.tokens and s.finish_reason == "" for p in seen for s in p.values())
    assert any(s.tokens[-1] in DIGITS for p in seen for s in p.values())


def test_the_calculator_and_the_calc_reward():
    assert calculator("48213+90377") == "138590" and calculator(" 2*(3-5) ") == "-4"
    assert calculator('{"name": "calculator", "arguments": {"expression": "7*6"}}') == "42"
    for bad in ("__import__('os')", "2**99999", "1/0", "x+1", "1" * 201):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)
    tok = _calc_tokenizer()
    task = CalcTask(tiny_cfg("task.name=calc").task, tok)
    p = task.sample(random.Random(0))
    a = p.answer
    said = lambda text: tok.encode(text) + [tok.eos_id]  # noqa: E731
    assert task.reward(p, said(f"[{p.id}]={a}\n{a}")) == 1.0 and task.reward(p, said(a)) == 1.0
    assert task.reward(p, said(f"[{p.id}]={a}\n{a}1")) == 0.0 and task.reward(p, tok.encode(a)) == 0.0
    m = task.episode_metrics([(p, said(f"[{p.id}]={a}\n{a}")), (p, said("[1+1]=2\n2")), (p, said(a))])
    assert m == pytest.approx({"tool/use_rate": 2 / 3, "tool/correct_rate": 1 / 3})


def test_the_qwen_call_format():
    q = FORMATS["qwen"]
    body = '{"name": "calculator", "arguments": {"expression": "1+2"}}'
    assert q.call(f"Let me compute.<tool_call>\n{body}\n</tool_call>") == f"\n{body}\n"
    assert q.call("no call</tool_call>") is None and q.call("<tool_call>x") is None
    assert calculator(q.call(f"<tool_call>{body}</tool_call>")) == "3"
    assert q.answer.format(result="3").startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n")


def test_self_distillation_refuses_episodes(tmp_path):
    from actor.distill import build_corpus

    cfg = tiny_cfg("task.name=calc", "task.digits=3", resolved=False)
    with pytest.raises(ValueError, match="multi-turn"):
        build_corpus(cfg, CalcTask.base_model(cfg), str(tmp_path / "corpus.jsonl"))


def test_a_tool_is_named_module_colon_function():
    from core import config as C

    assert C.load(None, ['task.tools.tool="pkg.mod:fn"']).task.tools.tool == "pkg.mod:fn"
    for bad in ("pkg.mod", "pkg.mod:fn:x", "a b:c"):
        with pytest.raises(Exception, match="task.tools.tool"):
            C.load(None, [f'task.tools.tool="{bad}"'])


def test_identical_episodes_each_get_their_turn():
    env = Scripted()
    a, b = (Sample([DIGITS[1]], [-0.1], [0], "tool") for _ in range(2))
    env.answer([(a, 8), (b, 8)])
    assert a.tokens == b.tokens == [DIGITS[1], *REPLY] and a.mask == [1, 0, 0] and env.asked == 2
