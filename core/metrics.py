"""Metrics plumbing: every role emits MetricRecords; the launcher collects them into
``run_dir/metrics.jsonl`` and hands them to the monitor.

Transport: ZeroMQ PUSH (one per role process) -> PULL (one, bound by the launcher).
DESIGN §1 draws this link as PUB/SUB; we use PUSH/PULL on purpose:

* PUB/SUB loses whatever is published before the subscription has propagated (the "slow
  joiner" problem), so the first records of a fast role -- step 0, the initial eval -- would
  silently vanish. PUSH queues them until the PULL side connects.
* A role must never stall because the monitor is slow or dead. The sink sends with
  ``zmq.NOBLOCK`` into a bounded queue (``SNDHWM``); when it is full the record is dropped and
  counted in ``MetricsSink.dropped`` instead of blocking the training loop.

Values are DESIGN §6 metric names mapped to a float or a list of floats. Non-finite floats are
kept (msgpack carries NaN/inf) and written to JSON as ``null``, so "no value this interval" is
visible in the log instead of being skipped.

Neither class is thread-safe (ZeroMQ sockets are not): use one sink per thread.
"""

from __future__ import annotations

import math
import os
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
    """Fire-and-forget metrics sender used inside each role process."""

    def __init__(
        self,
        host: str,
        port: int,
        role: str,
        id: str,
        ctx: zmq.Context | None = None,
        curve: net.Curve | None = None,
        hwm: int = SINK_HWM,
    ):
        self.role, self.id = role, id
        self.sent = 0
        self.dropped = 0
        self._own_ctx = ctx is None
        self._ctx = zmq.Context(io_threads=1) if ctx is None else ctx
        self._sock = net.socket(self._ctx, zmq.PUSH, linger_ms=0, hwm=hwm)
        net.connect(self._sock, host, port, curve)
        self._closed = False

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


def record_to_json(rec: MetricRecords) -> bytes:
    """One metrics.jsonl line (without newline). NaN/inf become null (msgspec's JSON rule);
    the envelope fields win over a metric that reuses their names."""
    row: dict = {k: v for k, v in rec.values.items() if k not in _RESERVED}
    row = {"step": rec.step, "time": rec.time, "role": rec.role, "id": rec.id, **row}
    return msgspec.json.encode(row)


class MetricsCollector:
    """The launcher's end: binds PULL, decodes, appends every record to metrics.jsonl."""

    def __init__(
        self,
        run_dir: str,
        host: str = "127.0.0.1",
        port: int = 0,
        ctx: zmq.Context | None = None,
        curve: net.Curve | None = None,
    ):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.received = 0
        self.invalid = 0
        self.last_error = ""
        self._own_ctx = ctx is None
        self._ctx = zmq.Context(io_threads=1) if ctx is None else ctx
        self._sock = net.socket(self._ctx, zmq.PULL, linger_ms=0, max_msg=MAX_FRAME_BYTES)
        self.port = net.bind(self._sock, host, port, curve)
        self._decode = decoder(TO_MONITOR).decode
        self._file = open(self.path, "ab")
        self._closed = False

    def poll(self, timeout_ms: int = 0, max_records: int = 10_000) -> list[MetricRecords]:
        """Wait up to ``timeout_ms`` for the first frame, then drain what is already queued
        (at most ``max_records``, so a flood cannot starve the caller's loop)."""
        out: list[MetricRecords] = []
        if self._closed or not self._sock.poll(max(0, int(timeout_ms)), zmq.POLLIN):
            return out
        for _ in range(max_records):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            rec = self._decode_frames(frames)
            if rec is not None:
                out.append(rec)
        if out:
            self._file.write(b"".join(record_to_json(r) + b"\n" for r in out))
            self._file.flush()
            self.received += len(out)
        return out

    def _decode_frames(self, frames: list[bytes]) -> MetricRecords | None:
        if len(frames) != 1:
            return self._reject(f"expected 1 frame, got {len(frames)}")
        try:
            msg = self._decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._reject(str(e))
        if isinstance(msg, Hello):
            return None  # a sink announcing itself; nothing to log
        if not math.isfinite(msg.time):
            return self._reject("non-finite record time")
        return msg

    def _reject(self, why: str) -> None:
        self.invalid += 1
        self.last_error = why[:200]
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._file.close()
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
