"""Metrics plumbing over real loopback ZeroMQ sockets, and the numeric helpers."""

import json
import math
import time

import msgspec
import numpy as np
import pytest
import zmq

from core import net
from core.messages import Hello, MetricRecords, Shutdown, encode
from core.metrics import MetricsCollector, MetricsSink, record_to_json
from core.stats import RateMeter, dense_histogram, histogram_counts, percentile


def drain(collector, want: int, deadline_s: float = 10.0) -> list[MetricRecords]:
    """Poll until `want` records of the roles arrived (the deadline only stops a hung test); the
    collector's own counter records are left out."""
    got, end = [], time.monotonic() + deadline_s
    while len(got) < want and time.monotonic() < end:
        got += [r for r in collector.poll(timeout_ms=100) if r.role != "monitor"]
    return got


def read_roles(path):
    return [row for row in read_jsonl(path) if row["role"] != "monitor"]


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def collector(tmp_path, ctx):
    col = MetricsCollector(str(tmp_path), ctx=ctx)
    yield col
    col.close()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_round_trip_writes_jsonl(collector, ctx):
    sink = MetricsSink("127.0.0.1", collector.port, role="learner", id="0", ctx=ctx)
    sink.emit(1, {"ratio/p99": 1.08, "learner/step": 1})
    sink.emit(2, {"learner/loss": float("nan"), "ratio/max": np.float32(1.5)})
    sink.emit(3, {"staleness/hist": np.array([4, 2, 0, 1]), "reward/mean": float("inf")})
    recs = drain(collector, 3)
    sink.close()

    assert [r.step for r in recs] == [1, 2, 3]
    assert all(r.role == "learner" and r.id == "0" for r in recs)
    assert recs[0].values == {"ratio/p99": 1.08, "learner/step": 1.0}
    assert math.isnan(recs[1].values["learner/loss"])  # kept on the wire, not dropped
    assert recs[2].values["staleness/hist"] == [4.0, 2.0, 0.0, 1.0]
    assert "reward/mean" not in recs[2].values  # inf: an overflow, not a measurement
    assert sink.sent == 3 and sink.dropped == 0
    assert collector.invalid == 0 and collector.values_dropped == 1

    rows = read_roles(collector.path)
    assert len(rows) == 3
    for row, rec in zip(rows, recs):
        assert row["step"] == rec.step and row["time"] == pytest.approx(rec.time)
        assert row["role"] == "learner" and row["id"] == "0"
    assert rows[0]["ratio/p99"] == 1.08
    assert rows[1]["learner/loss"] is None  # NaN -> null
    assert rows[1]["ratio/max"] == 1.5
    assert "reward/mean" not in rows[2]
    counters = [row for row in read_jsonl(collector.path) if row["role"] == "monitor"]
    assert counters[-1]["monitor/values_dropped"] == 1.0  # the drop is visible in the log
    assert rows[2]["staleness/hist"] == [4.0, 2.0, 0.0, 1.0]


def test_envelope_fields_win_over_metric_names():
    rec = MetricRecords(role="actor", id="1", step=7, time=5.0, values={"step": 99.0, "a/b": 1.0})
    row = json.loads(record_to_json(rec))
    assert row["step"] == 7 and row["a/b"] == 1.0 and row["role"] == "actor"


def test_collector_counts_malformed_frames_and_keeps_working(collector, ctx):
    raw = net.socket(ctx, zmq.DEALER)
    net.connect(raw, "127.0.0.1", collector.port)
    raw.send(b"\x93not msgpack at all")
    raw.send(encode(Shutdown(reason="wrong socket")))  # valid msgpack, not a TO_MONITOR type
    raw.send_multipart([b"two", b"frames"])
    raw.send(encode(Hello(role="actor", id="0")))  # allowed, but nothing to log
    good = MetricRecords(role="buffer", id="0", step=4, time=time.time(),
                         values={"buffer/depth": 3})
    raw.send(encode(good))
    recs = drain(collector, 1)
    raw.close()

    assert [r.values for r in recs] == [{"buffer/depth": 3.0}]
    assert collector.invalid == 3
    assert collector.last_error
    rows = read_roles(collector.path)
    assert len(rows) == 1 and rows[0]["buffer/depth"] == 3.0


def test_sink_without_collector_never_blocks(ctx):
    port = net.free_port()  # nothing listens here
    sink = MetricsSink("127.0.0.1", port, role="actor", id="0", ctx=ctx, hwm=100)
    for i in range(10_000):
        sink.emit(i, {"actor/tokens_per_s": 1.0})
    # the call returned; overflow beyond the bounded queue was counted, not waited on
    assert sink.sent + sink.dropped == 10_000
    assert sink.dropped >= 10_000 - 2 * 100
    sink.close()
    sink.emit(1, {"x": 1.0})  # after close: counted, no exception
    assert sink.sent + sink.dropped == 10_001


def test_records_sent_before_collector_binds_are_delivered(tmp_path, ctx):
    # the PUSH/PULL choice over PUB/SUB: an early record (step 0) is queued, not lost
    port = net.free_port()
    sink = MetricsSink("127.0.0.1", port, role="actor", id="0", ctx=ctx)
    sink.emit(0, {"eval/reward": 0.1})
    col = MetricsCollector(str(tmp_path), port=port, ctx=ctx)
    try:
        recs = drain(col, 1)
    finally:
        col.close()
        sink.close()
    assert [(r.step, r.values["eval/reward"]) for r in recs] == [(0, 0.1)]


def test_sink_with_own_context_closes(collector):
    with MetricsSink("127.0.0.1", collector.port, role="learner", id="0") as sink:
        sink.emit(5, {"learner/step": 5})
    assert [r.step for r in drain(collector, 1)] == [5]


@pytest.mark.parametrize("bad", ["1.0", True, {"a": 1.0}, [1.0, "x"], None])
def test_sink_rejects_non_numeric_values(ctx, bad):
    sink = MetricsSink("127.0.0.1", net.free_port(), role="learner", id="0", ctx=ctx)
    with pytest.raises(TypeError, match="metric 'k'"):
        sink.emit(0, {"k": bad})
    sink.close()


def test_collector_refuses_insecure_public_bind(tmp_path, ctx):
    with pytest.raises(net.InsecureBindError):
        MetricsCollector(str(tmp_path), host="0.0.0.0", ctx=ctx)


def test_jsonl_line_decodes_as_json_object():
    rec = MetricRecords(role="a", id="0", step=1, time=2.0, values={"x": [1.0, float("nan")]})
    assert msgspec.json.decode(record_to_json(rec)) == {
        "step": 1, "time": 2.0, "role": "a", "id": "0", "x": [1.0, None]
    }


# ---- stats ----------------------------------------------------------------------------------


def test_percentile():
    vals = list(range(101))
    assert percentile(vals, 50) == 50.0
    assert percentile(vals, 99) == 99.0
    assert percentile(np.array([[3.0, 1.0], [2.0, 4.0]]), 100) == 4.0
    assert math.isnan(percentile([], 99))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_histogram_helpers():
    vals = [3, 0, 1, 1, np.int64(3), 3]
    assert histogram_counts(vals) == {0: 1, 1: 2, 3: 3}
    assert list(histogram_counts(vals)) == [0, 1, 3]
    assert dense_histogram(vals) == [1.0, 2.0, 0.0, 3.0]
    assert dense_histogram(vals, upto=5) == [1.0, 2.0, 0.0, 3.0, 0.0, 0.0]
    assert dense_histogram([]) == []
    with pytest.raises(ValueError):
        dense_histogram([0, -1])


def test_rate_meter():
    clock = iter([0.0])
    m = RateMeter(halflife_s=1.0, clock=lambda: next(clock))
    assert m.rate == 0.0
    assert m.add(100, now=1.0) == pytest.approx(100.0)  # first interval seeds the estimate
    m.add(200, now=2.0)  # instantaneous 200/s, one half-life later: halfway there
    assert m.rate == pytest.approx(150.0)
    m.add(50, now=2.0)  # same instant: deferred, no division by zero
    assert m.rate == pytest.approx(150.0)
    m.add(150, now=3.0)  # 200 events over 1 s, pending included
    assert m.rate == pytest.approx(175.0)
    assert m.total == 500


def test_records_from_another_process_arrive_after_it_exits(collector):
    # a role process emits and exits at once: close() must give its queue time to leave
    import subprocess
    import sys

    code = (
        "import sys; from core.metrics import MetricsSink\n"
        "s = MetricsSink('127.0.0.1', int(sys.argv[1]), role='actor', id='7')\n"
        "[s.emit(i, {'actor/tokens_per_s': float(i)}) for i in range(50)]\n"
        "s.close()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(collector.port)])
    try:
        recs = drain(collector, 50)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [r.step for r in recs] == list(range(50))
    assert {(r.role, r.id) for r in recs} == {("actor", "7")}
