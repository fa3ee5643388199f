"""Metrics plumbing: every role emits MetricRecords; the launcher collects them into
``run_dir/metrics.jsonl`` and hands them to the monitor.

Transport: ZeroMQ DEALER (one per role process) -> ROUTER (one, bound by the launcher).
DESIGN §1 draws this link as PUB/SUB; we use a queueing pair on purpose:

* PUB/SUB loses whatever is published before the subscription has propagated (the "slow
  joiner" problem), so the first records of a fast role -- step 0, the initial eval -- would
  silently vanish. A connected DEALER queues them until the collector is there.
* A role must never stall because the monitor is slow or dead. The sink sends with
  ``zmq.NOBLOCK`` into a bounded queue (``SNDHWM``); when it is full the record is dropped and
  counted in ``MetricsSink.dropped`` instead of blocking the training loop.
* ROUTER, not PULL: the collector must know which connection a record came from. Any local
  process can reach a loopback port, so each sink first sends a ``Hello`` carrying the run's
  secret (core.net.run_secret); once the collector has a secret, records from a connection
  that did not present it are dropped and counted. A sink keeps one random routing id, so a
  reconnect keeps its authentication (ROUTER_HANDOVER). Off loopback the collector binds with
  CURVE and a ZAP allow-list (core.net.serve_curve) and sinks connect with CURVE client keys:
  :func:`collector_for` and :func:`sink_for` build both ends from a run's config.

Values are DESIGN §6 metric names mapped to a float or a list of floats. NaN means "no value
this interval" (a p99 of no samples): it is kept and written to JSON as ``null``. ±inf never
is a measurement (an overflow), so the collector drops such a value (a list holding one too)
and counts it; a record with a non-finite time is dropped whole. The collector's counters reach
the view and the log as a ``monitor``/``collector`` record (``monitor/records_rejected``,
``monitor/invalid_frames``, ``monitor/values_dropped``, ``monitor/write_errors``).

A failed write of metrics.jsonl (a full disk, any OSError) never leaves the collector: it is
logged once, naming the file, counted, and the run goes on -- metrics are not worth stopping
training for. Writes resume when the disk does; a line torn by the failure is terminated.

TensorBoard (``metrics.tensorboard = true``, extra ``tensorboard``): the collector also writes
every finite scalar of every record to event files under ``run_dir/tensorboard/<role>/<id>/``
(:class:`TensorBoardWriter`), under the same metric names as metrics.jsonl; one TensorBoard run
per source, so two actors' ``actor/tokens_per_s`` stay two curves, as they are two lines in the
JSONL. The step is the record's; a launcher record (step -1: ``run/restarts/<role>``, the final
eval) is placed at the latest learner step the collector has seen, which is the learner step at
that wall-clock time. The record's time is the event's wall time. NaN ("no value") and list
values (``staleness/hist``) are not written: a TensorBoard histogram is a distribution of values,
not counts by index, and would mislabel it. tensorboardX imports torch when torch is installed
(``tensorboardX/writer.py``); the launcher has it loaded already (the start-up contract check).

Neither class is thread-safe (ZeroMQ sockets are not): use one sink per thread.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import os
import secrets
import time
from numbers import Real

import msgspec
import zmq

from core import net
from core.messages import Hello, MetricRecords, TO_MONITOR, decoder, encode

# a few thousand small records: minutes of backlog at a 2 s emit period, a few MB at most
SINK_HWM = 1000
# a metrics frame is a few KB; anything far larger is garbage and must not be allocated
MAX_FRAME_BYTES = 4 << 20
_RESERVED = ("step", "time", "role", "id")

log = logging.getLogger(__name__)


def _as_value(key: str, v) -> float | list[float]:
    # numpy scalars/arrays and ints are coerced here so the encoder never sees a foreign type
    if isinstance(v, bool) or isinstance(v, str):
        raise TypeError(f"metric {key!r}: expected a number or a list of numbers, got {v!r}")
    if isinstance(v, Real):
        return float(v)
    if hasattr(v, "tolist"):
        v = v.tolist()
        if isinstance(v, Real) and not isinstance(v, bool):
            return float(v)
    if isinstance(v, (list, tuple)) and all(
        isinstance(x, Real) and not isinstance(x, bool) for x in v
    ):
        return [float(x) for x in v]
    raise TypeError(
        f"metric {key!r}: expected a number or a list of numbers, got {type(v).__name__}"
    )


class MetricsSink:
    """Fire-and-forget metrics sender used inside each role process. ``token``: the run's secret
    (core.net.run_secret), presented in the first frame; :func:`sink_for` fills everything in."""

    def __init__(
        self,
        host: str,
        port: int,
        role: str,
        id: str,
        ctx: zmq.Context | None = None,
        curve: net.Curve | None = None,
        hwm: int = SINK_HWM,
        token: str = "",
    ):
        self.role, self.id = role, id
        self.sent = 0
        self.dropped = 0
        self._own_ctx = ctx is None
        self._ctx = zmq.Context(io_threads=1) if ctx is None else ctx
        self._sock = net.socket(self._ctx, zmq.DEALER, linger_ms=0, hwm=hwm)
        # fixed and unguessable: a reconnect is the same, authenticated, peer to the collector
        self._sock.setsockopt(zmq.ROUTING_ID, b"m" + secrets.token_bytes(15))
        net.connect(self._sock, host, port, curve)
        self._closed = False
        self._sock.send(encode(Hello(role=role, id=id, token=token)), zmq.NOBLOCK)  # first in the queue

    def emit(self, step: int, values: dict) -> None:
        """Queue one record; never blocks. Raises TypeError only for a value that is not a number
        or list of numbers (a caller bug, reported where it happens)."""
        clean = {str(k): _as_value(k, v) for k, v in values.items()}
        if self._closed:
            self.dropped += 1
            return
        rec = MetricRecords(
            role=self.role, id=self.id, step=int(step), time=time.time(), values=clean
        )
        frame = encode(rec)
        try:
            self._sock.send(frame, zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError:
            # zmq.Again (queue full: monitor slow or absent) or a torn-down socket: the run goes on
            self.dropped += 1

    def close(self, linger_ms: int = 200) -> None:
        """Close the socket, giving queued records up to ``linger_ms`` to leave (bounded wait)."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=linger_ms)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sink_for(cfg, run_dir: str, role: str, id: str, **kw) -> MetricsSink:
    """The sink of a role of the run in ``run_dir``: the configured collector address, CURVE
    client keys if the run has them, and the run's secret."""
    return MetricsSink(cfg.net.host, cfg.net.metrics_port, role, id, curve=net.curve_from_config(cfg.net),
                       token=net.run_secret(run_dir), **kw)


def collector_for(cfg, run_dir: str) -> "MetricsCollector":
    """The launcher's collector: binds ``net.host:net.metrics_port``, with CURVE and a ZAP
    allow-list when the run has keys, and admits only sinks that present the run's secret; with
    ``metrics.tensorboard`` it also writes TensorBoard event files (ConfigError without the
    package, before anything is bound or started)."""
    tb = TensorBoardWriter(run_dir) if cfg.metrics.tensorboard else None
    ctx = zmq.Context(io_threads=1)
    try:
        curve, auth = net.serve_curve(ctx, cfg.net)
        col = MetricsCollector(run_dir, cfg.net.host, cfg.net.metrics_port, ctx=ctx, curve=curve,
                               secret=net.run_secret(run_dir), auth=auth, tensorboard=tb)
    except BaseException:
        ctx.destroy(linger=0)
        if tb is not None:
            tb.close()
        raise
    col._own_ctx = True  # closes the context (and the ZAP thread) with the collector
    return col


def finite_values(values: dict) -> tuple[dict, list[str]]:
    """``values`` without ±inf (a list holding one goes too), and the dropped keys. NaN stays:
    it means "no value this interval"."""
    keep, dropped = {}, []
    for k, v in values.items():
        if any(map(math.isinf, v)) if isinstance(v, list) else math.isinf(v):
            dropped.append(k)
        else:
            keep[k] = v
    return keep, dropped


def record_to_json(rec: MetricRecords) -> bytes:
    """One metrics.jsonl line (without newline). NaN/inf become null (msgspec's JSON rule);
    the envelope fields win over a metric that reuses their names."""
    row: dict = {k: v for k, v in rec.values.items() if k not in _RESERVED}
    row = {"step": rec.step, "time": rec.time, "role": rec.role, "id": rec.id, **row}
    return msgspec.json.encode(row)


def _json_value(v) -> float | list[float] | None:
    """A metric read back from JSON: null (a NaN on write) is NaN again; None if not a metric."""
    if v is None:
        return math.nan
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, list) and all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))
                                   for x in v):
        return [math.nan if x is None else float(x) for x in v]
    return None


def record_from_json(row) -> MetricRecords:
    """The inverse of :func:`record_to_json` (``row`` parsed): a value that is not a number or a
    list of numbers is left out. Raises ValueError for a row without a valid envelope."""
    if not isinstance(row, dict):
        raise ValueError(f"a metrics line is a JSON object, got {type(row).__name__}")
    step, t, role, id_ = (row.get(k) for k in _RESERVED)
    if not (isinstance(step, int) and not isinstance(step, bool) and isinstance(t, (int, float))
            and not isinstance(t, bool) and isinstance(role, str) and isinstance(id_, str)):
        raise ValueError(f"a metrics line needs int step, number time, str role and id: {str(row)[:80]}")
    values = {k: _json_value(v) for k, v in row.items() if k not in _RESERVED}
    return MetricRecords(role=role, id=id_, step=step, time=float(t),
                         values={k: v for k, v in values.items() if v is not None})


TENSORBOARD_DIR = "tensorboard"


def _path_part(name: str) -> str:
    """A role or id as one directory name (they are short identifiers; anything else is made so)."""
    out = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in name)[:64]
    return out if out.strip(".") else "_"


class TensorBoardWriter:
    """Every finite scalar of every record as TensorBoard events (the module docstring says how)."""

    def __init__(self, run_dir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            from core.config import ConfigError

            raise ConfigError("`$.metrics.tensorboard` = true needs tensorboardX: "
                              "pip install -e '.[tensorboard]'") from None
        self._make = SummaryWriter
        self.root = os.path.join(run_dir, TENSORBOARD_DIR)
        self._writers: dict[tuple[str, str], object] = {}
        self.learner_step = 0  # where step -1 (launcher) records are placed

    def _writer(self, role: str, id: str):
        key = (role, id)
        if key not in self._writers:
            logdir = os.path.join(self.root, _path_part(role), _path_part(id))
            self._writers[key] = self._make(logdir=logdir, flush_secs=5)
        return self._writers[key]

    def write(self, records: list[MetricRecords]) -> None:
        for rec in records:
            if rec.role == "learner" and rec.step >= 0:
                self.learner_step = rec.step
            step = rec.step if rec.step >= 0 else self.learner_step
            w = self._writer(rec.role, rec.id)
            for k, v in rec.values.items():
                if isinstance(v, float) and math.isfinite(v):
                    w.add_scalar(k, v, global_step=step, walltime=rec.time)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()


class MetricsCollector:
    """The launcher's end: binds ROUTER, decodes, appends every record to metrics.jsonl.

    ``secret``: the run's secret; when set, only connections whose Hello carried it are heard.
    ``auth``: a running ZAP authenticator (core.net.serve_curve) to stop at close.
    ``tensorboard``: a :class:`TensorBoardWriter` that also gets every record (closed with it)."""

    def __init__(
        self,
        run_dir: str,
        host: str = "127.0.0.1",
        port: int = 0,
        ctx: zmq.Context | None = None,
        curve: net.Curve | None = None,
        *,
        secret: str | None = None,
        auth=None,
        tensorboard: TensorBoardWriter | None = None,
    ):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.received = 0
        self.invalid = 0  # frames that are not a MetricRecords or Hello, or a wrong Hello
        self.rejected = 0  # records from a connection that did not present the secret
        self.values_dropped = 0  # ±inf values (a record with a non-finite time counts as invalid)
        self.write_errors = 0  # failed appends to metrics.jsonl
        self.tensorboard_errors = 0  # failed TensorBoard writes (metrics.tensorboard)
        self.last_error = ""
        self._secret = secret.encode() if secret else None
        self._authed: set[bytes] = set()
        self._reported: tuple = (0, 0, 0, 0)
        self._torn = False
        self._auth = auth
        self._tb = tensorboard
        self._own_ctx = ctx is None
        self._ctx = zmq.Context(io_threads=1) if ctx is None else ctx
        self._sock = net.socket(self._ctx, zmq.ROUTER, linger_ms=0, max_msg=MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a sink reconnecting under its routing id
        self.port = net.bind(self._sock, host, port, curve)
        self._decode = decoder(TO_MONITOR).decode
        self._file = open(self.path, "ab", buffering=0)  # one write per poll; nothing half-buffered
        self._closed = False

    def poll(self, timeout_ms: int = 0, max_records: int = 10_000) -> list[MetricRecords]:
        """Wait up to ``timeout_ms`` for the first frame, then drain what is already queued
        (at most ``max_records``, so a flood cannot starve the caller's loop). Never raises for
        a bad frame or a failed write: both are counted."""
        out: list[MetricRecords] = []
        if self._closed or not self._sock.poll(max(0, int(timeout_ms)), zmq.POLLIN):
            return out
        for _ in range(max_records):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            rec = self._accept(frames)
            if rec is not None:
                out.append(rec)
        out.extend(self._counters())
        if out:
            self._append(b"".join(record_to_json(r) + b"\n" for r in out))
            self._to_tensorboard(out)
            self.received += len(out)
        return out

    def _accept(self, frames: list[bytes]) -> MetricRecords | None:
        """The record in one ROUTER message ([routing id, frame]), or None (counted)."""
        if len(frames) != 2:
            return self._reject(f"expected 1 frame, got {len(frames) - 1}")
        peer, msg = frames[0], self._decode_frame(frames[1])
        if isinstance(msg, Hello):
            return self._hello(peer, msg)
        if msg is None:
            return None
        if self._secret is not None and peer not in self._authed:
            self.rejected += 1
            return None
        return self._clean(msg)

    def _decode_frame(self, frame: bytes):
        try:
            return self._decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._reject(str(e))

    def _hello(self, peer: bytes, hello: Hello) -> None:
        if self._secret is None:
            return None  # nothing to prove; nothing to log
        if hmac.compare_digest(hello.token.encode(), self._secret):
            self._authed.add(peer)
            return None
        return self._reject(f"a Hello from {hello.role}/{hello.id} without the run's secret")

    def _clean(self, rec: MetricRecords) -> MetricRecords | None:
        if not math.isfinite(rec.time):
            return self._reject("non-finite record time")
        values, dropped = finite_values(rec.values)
        if not dropped:
            return rec
        self.values_dropped += len(dropped)
        self.last_error = f"{rec.role}/{rec.id}: infinite value of {dropped[0]!r} dropped"[:200]
        return msgspec.structs.replace(rec, values=values)

    def _reject(self, why: str) -> None:
        self.invalid += 1
        self.last_error = why[:200]
        return None

    def _counters(self) -> list[MetricRecords]:
        """A record of the collector's own counters, when one changed since the last."""
        now = (self.rejected, self.invalid, self.values_dropped, self.write_errors)
        if now == self._reported:
            return []
        self._reported = now
        names = ("records_rejected", "invalid_frames", "values_dropped", "write_errors")
        values = {f"monitor/{n}": float(v) for n, v in zip(names, now)}
        return [MetricRecords(role="monitor", id="collector", step=-1, time=time.time(), values=values)]

    def _append(self, data: bytes) -> None:
        """Append to metrics.jsonl; a failure is one log line, then only counted."""
        try:
            self._file.write(b"\n" + data if self._torn else data)
        except OSError as e:
            self._torn = True  # the failed write may have left part of a line
            self.write_errors += 1
            if self.write_errors == 1:
                log.error("metrics: cannot write %s (%s); the run continues, metrics are not recorded "
                          "there until it can write again", self.path, e.strerror or e)
            return
        if self._torn:
            self._torn = False
            log.warning("metrics: writing %s again (%d writes failed)", self.path, self.write_errors)

    def _to_tensorboard(self, records: list[MetricRecords]) -> None:
        """As for metrics.jsonl: a failure is logged once, counted, and the run goes on."""
        if self._tb is None:
            return
        try:
            self._tb.write(records)
        except Exception as e:  # noqa: BLE001 -- an OSError, or tensorboardX's own
            self.tensorboard_errors += 1
            if self.tensorboard_errors == 1:
                log.error("metrics: cannot write TensorBoard events under %s (%s); the run continues",
                          self._tb.root, e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tb is not None:
            with contextlib.suppress(Exception):  # as in _to_tensorboard: never fatal
                self._tb.close()
        with contextlib.suppress(OSError):  # a full disk already counted; closing flushes nothing
            self._file.close()
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
