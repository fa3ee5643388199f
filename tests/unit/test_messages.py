import math

import msgspec
import numpy as np
import pytest

from core import messages as M


def _group(**kw):
    comp = M.make_completion([5, 6, 2], [-0.1, -0.2, -0.3], [3, 3, 4], "stop", 1.0)
    base = dict(actor_id="a0", seq=7, group_id="g", task="arith", tier="default",
                prompt_tokens=np.array([1, 2, 3], dtype="<i4").tobytes(), completions=[comp, comp],
                start_version=3, created_at=1.5)
    base.update(kw)
    return M.RolloutGroup(**base)


ALL = [
    M.Hello(role="actor", id="a0"),
    M.Shutdown(reason="done"),
    _group(),
    M.Ack(actor_id="a0", seq=1, status="ok"),
    M.SampleRequest(request_id=1, num_groups=8, learner_version=3),
    M.SampleBatch(request_id=1, groups=[_group()], depth=4),
    M.Consumed(keys=[("a0", 1), ("a1", 2)], learner_version=4),
    M.WeightUpdateHeader(version=1, names=["w"], dtypes=["float32"], shapes=[[2, 3]],
                         buckets=[M.Bucket(dtype="float32", names=["w"], offsets=[0], nbytes=24)]),
    M.MetricRecords(role="learner", id="l", step=3, time=1.0, values={"ratio/p99": 1.2, "staleness/hist": [3.0, 1.0]}),
]


@pytest.mark.parametrize("msg", ALL, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    dec = M.decoder(type(msg))
    assert dec.decode(M.encode(msg)) == msg
    union = M.decoder(M.Union[tuple(type(m) for m in ALL)])
    assert union.decode(M.encode(msg)) == msg


def test_socket_decoder_rejects_messages_not_meant_for_it():
    with pytest.raises(msgspec.ValidationError):
        M.decoder(M.ACTOR_TO_BUFFER).decode(M.encode(M.SampleRequest(request_id=1, num_groups=1, learner_version=0)))
    with pytest.raises(msgspec.ValidationError):
        M.decoder(M.BUFFER_TO_ACTOR).decode(M.encode(M.Shutdown(reason="not the buffer's")))


@pytest.mark.parametrize("old", [1, 2, 3, 4, 5])
def test_a_group_of_an_older_schema_is_refused_by_validation(old):
    # schema 1 frames carried by-reference fields, schema 2 Hellos no secret, schema 3 peers know
    # no Control message, schema 4 buffers take one group per message, schema 5 learners train environment
    # tokens as sampled: refused
    assert M.SCHEMA_VERSION == 6
    with pytest.raises(M.InvalidMessage, match="schema_version"):
        M.validate_group(_group(schema_version=old))


def test_hello_carries_the_token_last_and_defaults_to_none():
    assert M.Hello("actor", "a0").token == ""
    assert msgspec.msgpack.decode(M.encode(M.Hello("actor", "a0", token="t"))) == ["hello", "actor", "a0", M.SCHEMA_VERSION, "t", -1, -1]


LIMITS = M.Limits(group_size=2, max_prompt_tokens=4, max_new_tokens=3, vocab_size=10)


@pytest.mark.parametrize("bad, reason", [
    (dict(completions=[M.make_completion([5, 6, 2], [-0.1] * 3, [3] * 3, "stop", 1.0)]), "group_size"),
    (dict(prompt_tokens=b""), "empty_prompt"),
    (dict(prompt_tokens=np.arange(5, dtype="<i4").tobytes()), "prompt_too_long"),
    (dict(prompt_tokens=np.array([1, 10], dtype="<i4").tobytes()), "token_out_of_vocab"),
    (dict(prompt_tokens=np.array([-1], dtype="<i4").tobytes()), "token_out_of_vocab"),
    (dict(completions=[M.make_completion([5, 6, 2], [-0.1] * 3, [3] * 3, "stop", 1.0),
                       M.make_completion([5, 10], [-0.1] * 2, [3] * 2, "stop", 1.0)]), "token_out_of_vocab"),
    (dict(completions=[M.make_completion([5, 6, 2, 1], [-0.1] * 4, [3] * 4, "length", 1.0)] * 2),
     "completion_too_long"),
])
def test_validate_group_enforces_the_runs_limits(bad, reason):
    assert M.validate_group(_group(), LIMITS) == (3, 4)  # the base group is within them
    with pytest.raises(M.InvalidMessage) as e:
        M.validate_group(_group(**bad), LIMITS)
    assert e.value.reason == reason


def test_vocab_size_zero_skips_only_the_upper_bound():
    big = dict(prompt_tokens=np.array([1, 10**6], dtype="<i4").tobytes())
    assert M.validate_group(_group(**big), M.Limits(vocab_size=0)) == (3, 4)
    with pytest.raises(M.InvalidMessage, match="token_out_of_vocab"):
        M.validate_group(_group(prompt_tokens=np.array([-5], dtype="<i4").tobytes()), M.Limits())


def test_bounded_decoder_refuses_oversized_arrays_before_building_them():
    """A 40 MB frame of two million empty completions is refused at its array header, without the
    memory of two million objects."""
    import tracemalloc

    empty = M.make_completion([], [], [], "stop", 0.0)
    frame = M.encode(_group(completions=[empty] * 2_000_000))
    dec = M.group_decoder(LIMITS, M.Hello)
    tracemalloc.start()
    with pytest.raises(msgspec.ValidationError) as e:
        dec.decode(frame)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert M.decode_reason(e.value) == "over_limit"
    assert peak < 1 << 20  # building them takes ~300 MB
    for field, value in [("prompt_tokens", np.arange(5, dtype="<i4").tobytes()),
                         ("completions", [M.make_completion([1] * 4, [-0.1] * 4, [0] * 4, "stop", 0.0)] * 2)]:
        with pytest.raises(msgspec.ValidationError) as e:
            dec.decode(M.encode(_group(**{field: value})))
        assert M.decode_reason(e.value) == "over_limit"
    ok = dec.decode(M.encode(_group()))
    assert isinstance(ok, M.RolloutGroup) and ok.key == ("a0", 7) and M.validate_group(ok, LIMITS) == (3, 4)
    assert isinstance(dec.decode(M.encode(M.Hello("actor", "a0"))), M.Hello)


def test_group_key_reads_the_key_without_the_arrays():
    assert M.group_key(M.encode(_group())) == ("a0", 7)
    for other in (M.encode(M.Hello("actor", "a0")), b"\x93\x01", b"", M.encode(M.Ack("a", 1, "ok"))):
        assert M.group_key(other) is None


def test_validation_gives_the_newest_token_version_or_the_start_version():
    comps = [M.make_completion([1, 2], [-0.1, -0.1], [3, 9], "stop", 0.0), M.make_completion([], [], [], "stop", 0.0)]
    assert M.validate_group(_group(completions=comps))[1] == 9
    assert M.validate_group(_group(completions=comps[1:], start_version=4))[1] == 4


def test_completion_arrays_and_min_version():
    g = _group()
    c = g.completions[0]
    assert c.num_tokens == 3
    assert c.token_array().tolist() == [5, 6, 2]
    assert np.allclose(c.logprob_array(), [-0.1, -0.2, -0.3])
    assert g.min_version() == 3 and g.key == ("a0", 7)
    assert M.validate_group(g) == (3, 4)


def test_min_version_is_the_oldest_token_version_or_the_start_version():
    rng = np.random.default_rng(0)
    for _ in range(50):
        comps = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(0, 20))
            versions = rng.integers(2, 9, n)
            comps.append(M.make_completion(rng.integers(0, 9, n), -rng.random(n), versions, "stop", 0.0))
        g = _group(completions=comps, start_version=2)
        per = [int(c.version_array().min()) for c in comps if c.num_tokens]  # the definition
        newest = max([2] + [int(c.version_array().max()) for c in comps if c.num_tokens])
        assert (g.min_version(), newest) == ((min(per) if per else 2), newest) == M.validate_group(g)


@pytest.mark.parametrize("bad, reason", [
    (dict(completions=[M.make_completion([1, 2], [-0.1], [0, 0], "stop", 0.0)]), "length_mismatch"),
    (dict(completions=[M.make_completion([1], [math.nan], [0], "stop", 0.0)]), "nonfinite_logprob"),
    (dict(completions=[M.make_completion([1], [-math.inf], [0], "stop", 0.0)]), "nonfinite_logprob"),
    (dict(completions=[M.make_completion([1], [-0.1], [0], "stop", math.inf)]), "nonfinite_reward"),
    (dict(completions=[M.make_completion([1], [0.5], [0], "stop", 0.0)]), "positive_logprob"),
    (dict(completions=[]), "empty_group"),
    (dict(schema_version=99), "schema_version"),
    (dict(completions=[M.make_completion([1], [-0.1], [0], "weird", 0.0)]), "finish_reason"),
])
def test_validate_group_rejects_with_reason(bad, reason):
    with pytest.raises(M.InvalidMessage) as e:
        M.validate_group(_group(**bad))
    assert e.value.reason == reason
