"""The metrics link among strangers: the run's secret, CURVE with an allow-list, a full disk.

Real loopback sockets. Absence checks (an intruder's record never arrives) poll a little past the
moment the legitimate record arrived, which was sent after the intruder's: the check can only
pass wrongly on a very slow host, never fail wrongly.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time

import pytest
import zmq

from core import net
from core.config import load
from core.messages import Hello, MetricRecords, encode
from core.metrics import MetricsCollector, MetricsSink, collector_for, sink_for


def _until(pred, collector, deadline_s: float = 10.0) -> list[MetricRecords]:
    got, end = [], time.monotonic() + deadline_s
    while not pred(got) and time.monotonic() < end:
        got += [r for r in collector.poll(timeout_ms=50) if r.role != "monitor"]
    return got


def _linger(collector, seconds: float = 0.5) -> list[MetricRecords]:
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        got += [r for r in collector.poll(timeout_ms=50) if r.role != "monitor"]
    return got


def _cfg(*overrides: str):
    return load(None, list(overrides))


@pytest.fixture
def run_dir(tmp_path):
    d = str(tmp_path)
    net.create_run_secret(d)
    return d


def test_records_without_the_runs_secret_are_dropped_and_counted(run_dir):
    secret = net.run_secret(run_dir)
    ctx = zmq.Context()
    col = MetricsCollector(run_dir, ctx=ctx, secret=secret)
    strangers = [MetricsSink("127.0.0.1", col.port, "actor", "no-token", ctx=ctx),
                 MetricsSink("127.0.0.1", col.port, "actor", "bad-token", ctx=ctx, token="0" * 64)]
    raw = ctx.socket(zmq.DEALER)  # skips the Hello altogether
    raw.connect(f"tcp://127.0.0.1:{col.port}")
    try:
        for s in strangers:
            s.emit(1, {"actor/tokens_per_s": 666.0})
        raw.send(encode(MetricRecords(role="actor", id="raw", step=1, time=time.time(),
                                      values={"actor/tokens_per_s": 666.0})))
        good = MetricsSink("127.0.0.1", col.port, "actor", "0", ctx=ctx, token=secret)
        good.emit(2, {"actor/tokens_per_s": 10.0})
        got = _until(lambda g: g, col)
        end = time.monotonic() + 10
        while col.rejected < 3 and time.monotonic() < end:
            got += [r for r in col.poll(timeout_ms=50) if r.role != "monitor"]
        assert [(r.id, r.values) for r in got] == [("0", {"actor/tokens_per_s": 10.0})]
        assert col.rejected == 3  # the three strangers' records
        assert col.invalid == 2 and "without the run's secret" in col.last_error  # the two bad Hellos
        counters = [json.loads(ln) for ln in open(col.path) if '"monitor"' in ln]
        assert counters[-1]["monitor/records_rejected"] == 3.0
    finally:
        for s in [*strangers, good]:
            s.close()
        raw.close(linger=0)
        col.close()
        ctx.term()


def test_sink_for_and_collector_for_wire_a_run(run_dir):
    cfg = _cfg()
    col = collector_for(cfg, run_dir)
    cfg = _cfg(f"net.metrics_port={col.port}")
    try:
        with sink_for(cfg, run_dir, "learner", "learner0") as sink:
            sink.emit(4, {"learner/step": 4.0})
            got = _until(lambda g: g, col)
    finally:
        col.close()
    assert [(r.role, r.step) for r in got] == [("learner", 4)] and col.rejected == 0


def test_curve_run_delivers_metrics_only_from_allowed_keys(run_dir):
    server_pub, server_sec = net.make_curve_keys()
    client_pub, client_sec = net.make_curve_keys()
    keys = [f'net.curve_server_public="{server_pub}"', f'net.curve_server_secret="{server_sec}"',
            f'net.curve_client_public="{client_pub}"', f'net.curve_client_secret="{client_sec}"']
    col = collector_for(_cfg(*keys), run_dir)  # CURVE forced on 127.0.0.1
    cfg = _cfg(*keys, f"net.metrics_port={col.port}")
    secret = net.run_secret(run_dir)
    ctx = zmq.Context()
    other_pub, other_sec = net.make_curve_keys()
    intruders = [  # right secret, but a key pair not on the allow-list / no CURVE at all
        MetricsSink("127.0.0.1", col.port, "actor", "wrong-key", ctx=ctx, token=secret,
                    curve=net.Curve(server_public=server_pub.encode(), client_public=other_pub.encode(),
                                    client_secret=other_sec.encode())),
        MetricsSink("127.0.0.1", col.port, "actor", "plain", ctx=ctx, token=secret),
    ]
    try:
        for s in intruders:
            s.emit(1, {"actor/tokens_per_s": 666.0})
        with sink_for(cfg, run_dir, "learner", "learner0") as sink:
            sink.emit(7, {"learner/step": 7.0})
            got = _until(lambda g: g, col)
        got += _linger(col)
    finally:
        for s in intruders:
            s.close()
        ctx.term()
        col.close()
    assert [(r.role, r.id, r.step) for r in got] == [("learner", "learner0", 7)]


def test_curve_collector_socket_is_a_curve_server(run_dir):
    server_pub, server_sec = net.make_curve_keys()
    client_pub, _ = net.make_curve_keys()
    col = collector_for(_cfg(f'net.curve_server_public="{server_pub}"', f'net.curve_server_secret="{server_sec}"',
                             f'net.curve_client_public="{client_pub}"'), run_dir)
    try:
        assert col._sock.curve_server and col._auth is not None
    finally:
        col.close()


# ---- a full disk ---------------------------------------------------------------------------------


class _Full:
    """A metrics file on a full disk (the kernel's /dev/full behaves the same, where present)."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_file():
    return open("/dev/full", "ab", buffering=0) if os.path.exists("/dev/full") else _Full()


def test_a_failed_metrics_write_is_one_line_and_the_run_continues(tmp_path, caplog):
    col = MetricsCollector(str(tmp_path))
    sink = MetricsSink("127.0.0.1", col.port, "learner", "0")
    good_file, col._file = col._file, _full_file()
    try:
        with caplog.at_level(logging.WARNING, logger="core.metrics"):
            for step in range(3):
                sink.emit(step, {"learner/step": float(step)})
                got = _until(lambda g: g, col)  # never raises
                assert [r.step for r in got] == [step]  # the view still gets every record
            assert col.write_errors == 3
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 1 and col.path in errors[0].getMessage()
            assert "No space left" in errors[0].getMessage()
            if not isinstance(col._file, _Full):
                col._file.close()
            col._file = good_file  # the disk has room again
            sink.emit(9, {"learner/step": 9.0})
            _until(lambda g: g, col)
        assert any("again" in r.getMessage() for r in caplog.records)
    finally:
        sink.close()
        col.close()
    rows = [json.loads(ln) for ln in open(col.path) if ln.strip()]  # every line is whole JSON
    assert [(r["role"], r["step"]) for r in rows] == [("learner", 9), ("monitor", -1)]
    assert rows[-1]["monitor/write_errors"] == 3.0  # and the failures are on record


def test_close_on_a_full_disk_does_not_raise(tmp_path):
    col = MetricsCollector(str(tmp_path))
    col._file.close()
    col._file = _Full()
    col.close()  # counted already; nothing to say twice
    assert col._closed
