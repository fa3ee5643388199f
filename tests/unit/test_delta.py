"""weightsync/delta.py: a delta carries exactly the elements whose bits changed, applies bit for bit,
gives way to a full version when that is due or smaller, and refuses a payload that does not fit."""

import pytest
import torch

from core import config as C
from core.messages import DeltaHeader
from weightsync import check_devices, delta, delta_plan


def _tensors(gen):
    return [torch.randn(40, 30, generator=gen).bfloat16(), torch.randn(77, generator=gen),
            torch.arange(12, dtype=torch.int64), torch.randn(5, 5, generator=gen).half()]


def _touch(ts, frac, gen):
    out = []
    for t in ts:
        t = t.clone()
        flat = t.view(-1)
        pick = torch.rand(flat.numel(), generator=gen) < frac
        flat[pick] = flat[pick] + 1 if not t.is_floating_point() else flat[pick] * 1.5 + 0.25
        out.append(t)
    return out


def _bits_equal(a, b):
    return all(x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
               for x, y in zip(a, b))


def test_a_delta_applies_bit_for_bit_over_its_base():
    gen = torch.Generator().manual_seed(0)
    enc, v0 = delta.Encoder(full_every=10), _tensors(gen)
    assert enc.encode(0, v0) is None  # the first version goes full
    enc.commit(0, v0, full=True)
    v1 = _touch(v0, 0.05, gen)
    v1[1][7] = float("nan")  # a NaN is a bit pattern like any other
    v1[1][8] = -v1[1][8].abs() * 0  # -0.0: equal as a number, different bits
    header, payload = enc.encode(1, v1)
    assert (header.version, header.base, header.full, header.epoch) == (1, 0, 0, enc.epoch)
    want = [int((x.view(-1).view(torch.uint8).view(-1, x.element_size()) !=
                 y.view(-1).view(torch.uint8).view(-1, x.element_size())).any(1).sum()) for x, y in zip(v0, v1)]
    assert header.counts == want and sum(want) > 0
    held = [t.clone() for t in v0]
    delta.apply(header, payload, held, [t.dtype for t in v1])
    assert _bits_equal(held, v1)
    assert 0 < enc.changed_frac < 0.2


def test_full_when_due_or_smaller_and_a_skipped_publish_keeps_the_base():
    gen = torch.Generator().manual_seed(1)
    enc, v0 = delta.Encoder(full_every=3), _tensors(gen)
    enc.commit(0, v0, full=True)
    assert enc.encode(1, _touch(v0, 0.9, gen)) is None  # most elements changed: the full version is smaller
    v1 = _touch(v0, 0.02, gen)
    header, _ = enc.encode(1, v1)
    # not committed (the transport dropped it): the next delta still applies to version 0
    v2 = _touch(v1, 0.02, gen)
    header, payload = enc.encode(2, v2)
    assert header.base == 0
    held = [t.clone() for t in v0]
    delta.apply(header, payload, held, [t.dtype for t in v2])
    assert _bits_equal(held, v2)
    enc.commit(2, v2, full=False)
    assert enc.encode(3, _touch(v2, 0.01, gen)) is None  # full_every versions since the full one


def test_a_payload_that_does_not_fit_is_refused_before_any_write():
    gen = torch.Generator().manual_seed(2)
    enc, v0 = delta.Encoder(full_every=10), _tensors(gen)
    enc.commit(0, v0, full=True)
    header, payload = enc.encode(1, _touch(v0, 0.1, gen))
    held, dtypes = [t.clone() for t in v0], [t.dtype for t in v0]
    with pytest.raises(ValueError, match="payload bytes"):
        delta.apply(header, payload[:-8], held, dtypes)
    bad = payload.clone()
    bad[:4].view(torch.int32)[0] = 10**6  # an index beyond its tensor
    with pytest.raises(ValueError, match="index beyond"):
        delta.apply(header, bad, held, dtypes)
    assert _bits_equal(held, v0)  # nothing written
    with pytest.raises(ValueError, match="tensors"):
        delta.apply(DeltaHeader(1, 0, 0, "x", header.counts[:2]), payload, held, dtypes)


def _cfg(*over):
    return C.load(None, ["actor.dtype=bfloat16", *over])


def test_auto_turns_deltas_on_only_where_they_pay():
    assert delta_plan(_cfg('weightsync.transport="filesystem"')) == (True, "bfloat16")
    assert delta_plan(_cfg()) == (False, "bfloat16")  # shm: one host, the actors map the version
    assert delta_plan(_cfg('weightsync.transport="filesystem"', "actor.dtype=float32"))[0] is False
    assert delta_plan(_cfg('weightsync.delta="on"')) == (True, "bfloat16")
    assert delta_plan(_cfg('weightsync.transport="filesystem"', 'weightsync.delta="off"'))[0] is False


def test_deltas_on_a_transport_that_cannot_send_them_is_a_config_error():
    cfg = _cfg('weightsync.transport="cuda_ipc"', 'weightsync.delta="on"', 'learner.device="cuda:0"',
               'actor.device="cuda:0"')
    with pytest.raises(C.ConfigError, match="deltas go over"):
        check_devices(cfg, n_gpus=1)
