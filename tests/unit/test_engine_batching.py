"""TorchEngine's continuous batching: more prompts than slots, ragged lengths, refills.

The reference is each prompt decoded alone (one slot, no neighbours, no refills, no moves), so
a slip in the per-row lengths, positions, masks, slot refills or the packing moves shows up as a
different greedy token or log-prob. Forward calls are observed through a forward pre-hook on the
model, so the schedule itself (rows per step, refills while others decode) is checked too.
"""

import random

import pytest
import torch

from model.kvcache import KVCache
from tests.support.tiny import tiny_engine, tiny_model, tiny_tokenizer

torch.set_num_threads(1)
TOK = tiny_tokenizer()


def _prompt(text: str) -> list[int]:
    return [TOK.bos_id, *TOK.encode(text)]


# the tiny model answers these with about 4 tokens (3 digits + EOS) ...
LONG = ["47+88=", "99+99=", "60+61="]
# ... and these with 2-3; two carry a worked-example prefix, for ragged prompt lengths (5-20)
SHORT = ["3+4=", "2+5=", "12+30=42 5+5=10 47+88=", "1+2=", "1+6=", "1+1=2 9+9="]


def _prompts(seed: int = 0) -> list[list[int]]:
    """Waves of (long, short, short) answers: lock-step in waves of 3 waits for every long one."""
    short = random.Random(seed).sample(SHORT, len(SHORT))
    return [_prompt(t) for i, long in enumerate(LONG) for t in (long, *short[2 * i:2 * i + 2])]


def _engine(max_batch: int, max_new_tokens: int = 6, **kw):
    engine = tiny_engine(**kw)
    engine.max_batch, engine.max_new_tokens = max_batch, max_new_tokens
    return engine


class Forwards:
    """Records (kind, rows, version) of every model forward: ``prefill`` when T > 1."""

    def __init__(self, engine):
        self.calls = []
        self.engine = engine
        engine.model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        ids = args[0]
        self.calls.append(("prefill" if ids.shape[1] > 1 else "decode", ids.shape[0], self.engine.version))

    def rows(self, kind: str) -> list[int]:
        return [rows for k, rows, _ in self.calls if k == kind]


def test_continuous_batching_equals_each_prompt_alone(monkeypatch):
    prompts = _prompts()
    engine = _engine(max_batch=3)
    moves, real_move = [], KVCache.move

    def move(cache, src, dst):  # the real move, counted
        moves.append((src, dst))
        real_move(cache, src, dst)

    monkeypatch.setattr(KVCache, "move", move)
    batched = engine.generate(prompts, greedy=True)
    alone = _engine(max_batch=1)
    for p, got in zip(prompts, batched):
        (want,) = alone.generate([p], greedy=True)
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason, p
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert len({len(s.tokens) for s in batched}) > 1, "ragged completions are what the schedule is about"
    assert moves, "the tail of the run packs running rows into freed slots"


def test_freed_slots_are_refilled_and_finished_rows_cost_nothing():
    prompts = _prompts()
    engine = _engine(max_batch=3)
    fwd = Forwards(engine)
    samples = engine.generate(prompts, greedy=True)
    assert max(rows for _, rows, _ in fwd.calls) <= 3
    # every decode row produced a token of a running sequence: no padding rows, no finished rows
    assert sum(fwd.rows("decode")) == sum(len(s.tokens) - 1 for s in samples)
    assert sum(fwd.rows("prefill")) == len(prompts)
    kinds = [k for k, _, _ in fwd.calls]
    assert "prefill" in kinds[kinds.index("decode"):], "a freed slot took a new prompt mid-run"
    # lock-step in waves of max_batch would decode each wave until its longest member is done
    waves = [samples[i:i + 3] for i in range(0, len(samples), 3)]
    assert len(fwd.rows("decode")) < sum(max(len(s.tokens) for s in w) - 1 for w in waves)


def test_a_groups_copies_of_one_prompt_are_prefilled_once_and_decode_as_if_alone():
    """An RL batch is G copies of each prompt: one prefill row per distinct prompt, its K/V copied to the
    copies' slots, and each copy then continues exactly as that prompt decoded alone."""
    a, b = _prompt(LONG[0]), _prompt(SHORT[2])
    prompts = [a, a, a, b, b, a]  # copies not adjacent either
    engine = _engine(max_batch=6)
    fwd = Forwards(engine)
    got = engine.generate(prompts, greedy=True)
    assert fwd.rows("prefill") == [2]
    alone = _engine(max_batch=1)
    for p, sample in zip(prompts, got):
        (want,) = alone.generate([p], greedy=True)
        assert sample.tokens == want.tokens and sample.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    sampled = _engine(max_batch=8, temperature=5.0).generate([a] * 8)  # each copy draws its own first token
    assert len({s.tokens[0] for s in sampled}) > 1


def test_stream_yields_every_index_once_as_sequences_finish():
    prompts = _prompts()
    engine = _engine(max_batch=3)
    fwd = Forwards(engine)
    seen, forwards_at_yield = [], []
    for i, sample in engine.stream(prompts, greedy=True):
        seen.append((i, sample))
        forwards_at_yield.append(len(fwd.calls))
    assert sorted(i for i, _ in seen) == list(range(len(prompts)))
    assert forwards_at_yield[0] < len(fwd.calls), "the first sample came out before the last forward"
    want = _engine(max_batch=3).generate(prompts, greedy=True)
    assert {i: s.tokens for i, s in seen} == {i: s.tokens for i, s in enumerate(want)}


def test_default_generate_puts_a_stream_back_in_prompt_order():
    from actor.engines import Engine, Sample
    from model.sampling import SamplingSpec

    class Reversed(Engine):
        """Streams in reverse completion order: the base class's generate must reorder it."""

        max_new_tokens = 1

        @classmethod
        def from_config(cls, actor_cfg, model_dir, weights=None, seed=0):
            return cls(weights)

        def sampling(self):
            return SamplingSpec()

        def _apply_weights(self):
            return None

        def _stream(self, prompts, limits, greedy):
            for i in reversed(range(len(prompts))):
                yield i, Sample([len(prompts[i])], [0.0], [0], "length")

    assert [s.tokens for s in Reversed().generate([[1], [1, 2], [3, 4, 5]])] == [[1], [2], [3]]


def _full_logp(model, prompt, tokens):
    """Log-probs (temperature 1) of ``tokens`` after ``prompt``: one unpadded forward, no cache."""
    ids = torch.tensor(prompt + tokens)[None]
    with torch.no_grad():
        logits = model.logits(model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool)))
    logp = torch.log_softmax(logits[0].double(), -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


class EveryForward:
    """A weight source with a new version before every forward; the weights change once, to
    ``new_state``, at version ``switch``."""

    def __init__(self, new_state: dict, switch: int):
        self.new_state, self.switch, self.applied = new_state, switch, -1

    def apply(self, params):
        self.applied += 1
        if self.applied == self.switch:
            for k, v in self.new_state.items():
                params[k].copy_(v)
        return self.applied


def test_versions_are_per_token_across_updates_and_refills():
    switch = 4  # new weights land before forward 4, between decode steps of the running rows
    old, new = tiny_model(), tiny_model()
    g = torch.Generator().manual_seed(11)
    new.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.state_dict().items()})
    prompts = _prompts()
    engine = _engine(max_batch=3)
    engine.weights, engine.version = EveryForward(new.state_dict(), switch), -1
    fwd = Forwards(engine)
    samples = engine.generate(prompts, greedy=True)
    produced = {version: rows for _, rows, version in fwd.calls}  # the version each forward ran with
    tagged = {}
    for s in samples:
        assert s.versions == sorted(set(s.versions)), "one token per forward, newest weights each time"
        for v in s.versions:
            tagged[v] = tagged.get(v, 0) + 1
    assert tagged == produced  # each forward's tokens carry that forward's version, and only those
    assert min(s.versions[0] for s in samples[3:]) > 0  # refilled slots start on newer weights
    before = [(p, s) for p, s in zip(prompts, samples) if s.versions[-1] < switch]
    after = [(p, s) for p, s in zip(prompts, samples) if s.versions[0] >= switch]
    assert before and after, "the schedule should finish some rows before the switch and admit some after"
    for model, group in ((old, before), (new, after)):
        for p, s in group:  # prefilled and decoded entirely under one set of weights
            assert s.logprobs == pytest.approx(_full_logp(model, p, s.tokens), abs=1e-4)


def test_cache_is_allocated_once_and_grown_geometrically():
    engine = _engine(max_batch=4)
    engine.generate(_prompts(), greedy=True)
    cache = engine._cache
    assert cache.slots == 4
    engine.generate(_prompts(seed=1), greedy=True)
    assert engine._cache is cache
    longest = max(map(len, _prompts()))
    engine.generate(_prompts(), max_new_tokens=cache.max_len - longest + 1, greedy=True)
    assert engine._cache is not cache and engine._cache.max_len >= 1.25 * cache.max_len
    assert engine._cache.slots == 4  # a call with fewer prompts than slots keeps them all


def test_bad_prompts():
    engine = _engine(max_batch=2)
    assert engine.generate([]) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[TOK.bos_id], []])


@pytest.mark.parametrize("vocab", [4, 600])  # one short chunk; two full chunks and a tail
def test_inverse_cdf_draw_follows_the_distribution(vocab):
    engine = _engine(max_batch=1)
    probs = torch.zeros(vocab)
    support = {0: 0.3, 1: 0.1, vocab - 1: 0.25, vocab // 2: 0.35}  # spread over the chunks
    for i, p in support.items():
        probs[i] = p
    logp = probs.log().expand(40_000, vocab).contiguous()  # log(0) = -inf: outside the support
    drawn = engine._draw(logp)
    freq = torch.bincount(drawn, minlength=vocab).double() / len(drawn)
    assert set(drawn.unique().tolist()) == set(support)
    assert torch.allclose(freq, probs.double(), atol=0.015), {i: freq[i].item() for i in support}
    again = _engine(max_batch=1)._draw(logp)  # the engine's seed fixes the stream
    assert torch.equal(drawn, again)


def test_inverse_cdf_edges_never_leave_the_support():
    from actor.engines.torch import _inverse_cdf

    probs = torch.zeros(3, 700)
    probs[:, 10], probs[:, 300], probs[:, 650] = 0.2, 0.5, 0.3
    u = torch.tensor([[0.0], [1.0], [0.5]], dtype=torch.float64)  # both edges of the CDF, a middle
    assert _inverse_cdf(probs, u).tolist() == [10, 650, 300]  # zero-probability neighbours never


def test_cache_overflow_names_the_limit():
    model = tiny_model()
    cache = KVCache(model.cfg, 2, 4, torch.float32)
    ids = torch.ones(3, 1, dtype=torch.long)
    with torch.no_grad(), pytest.raises(RuntimeError, match="over 3 rows, the cache has 2 slots"):
        model(ids, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool), cache)
    ids = torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad(), pytest.raises(RuntimeError, match="position 4 in a cache of 4 positions"):
        model(ids, torch.arange(5).expand(2, 5), torch.ones(2, 5, dtype=torch.bool), cache)


def test_a_set_stop_event_ends_generation_between_two_steps():
    """SIGTERM mid-batch: the engine gives up at the next step instead of finishing a long batch
    (the launcher SIGKILLs an actor that takes 20 s to stop)."""
    import threading

    from actor.engines import EngineStopped
    from tests.support.tiny import tiny_engine

    engine = tiny_engine()
    engine.stop = threading.Event()
    engine.eos_ids = torch.zeros(0, dtype=torch.long)  # nothing stops by itself: 50 steps unless stopped
    calls = []
    real = engine.model.forward

    def forward(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            engine.stop.set()
        return real(*a, **k)

    engine.model.forward = forward
    with pytest.raises(EngineStopped):
        engine.generate([[1, 5, 6]] * 4, max_new_tokens=50)
    assert len(calls) == 3


def test_every_decode_step_calls_on_step():
    """The worker's heartbeat rides on ``on_step``: a long batch of one long sequence (minutes on
    a big model) beats every step, so the launcher never takes it for a hung actor."""
    from tests.support.tiny import tiny_engine

    engine = tiny_engine()
    engine.eos_ids = torch.zeros(0, dtype=torch.long)  # every sequence runs its full budget
    steps, forwards = [], []
    real = engine.model.forward

    def forward(*a, **k):
        forwards.append(1)
        return real(*a, **k)

    engine.model.forward = forward
    engine.on_step = lambda: steps.append(len(forwards))
    engine.generate([[1, 5, 6]] * 2, max_new_tokens=12)
    assert len(forwards) >= 12 and len(steps) >= len(forwards)  # at least one beat per forward
    assert steps == sorted(steps) and steps[0] == 0  # before the first forward, then as it goes
