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


def test_a_schema_1_group_is_refused_by_validation():
    # schema 1 frames carried by-reference fields; a peer still speaking it must be refused
    assert M.SCHEMA_VERSION == 2
    with pytest.raises(M.InvalidMessage, match="schema_version"):
        M.validate_group(_group(schema_version=1))


def test_completion_arrays_and_min_version():
    g = _group()
    c = g.completions[0]
    assert c.num_tokens == 3
    assert c.token_array().tolist() == [5, 6, 2]
    assert np.allclose(c.logprob_array(), [-0.1, -0.2, -0.3])
    assert g.min_version() == 3 and g.key == ("a0", 7)
    assert M.validate_group(g) == 3


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
        assert g.min_version() == (min(per) if per else 2) == M.validate_group(g)


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
