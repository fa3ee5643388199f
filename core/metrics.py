"""Metrics as files (how they travel: ARCHITECTURE.md, Metric vocabulary). The follower records how far it merged in
``metrics.merged.json``: a crash repeats lines, never loses them. NaN is "no value" (JSON null); ±inf is an overflow,
dropped and counted. Not thread-safe: one writer per thread and file."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import time
from numbers import Real

import msgspec

from core.config import ConfigError
from core.files import atomic_write, read_json
from core.messages import MetricRecords

METRICS_DIR = "metrics"  # run_dir/metrics/<role>-<id>.jsonl: one writer each
MERGED_FILE = "metrics.jsonl"  # every role's records, merged by the launcher
MERGED_STATE = "metrics.merged.json"  # role file name -> [bytes merged, inode]
READ_CHUNK = 1 << 20  # bytes per read of one file: a big backlog (or a huge line) comes in slices
MAX_LINE = 1 << 20  # a record is a few KB; a longer line is skipped (and counted) unparsed
MAX_DEPTH = 8  # a record nests 2 deep (an object of lists); json.loads recurses: deeper is checked before it
MAX_LIST = 1024  # a list-valued metric longer than this is dropped (and counted)
_RESERVED = ("step", "time", "role", "id")

log = logging.getLogger(__name__)


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _value(v, null: bool) -> float | list[float] | None:
    """Floats of a number or list of numbers (numpy's too; with ``null``, JSON null as NaN); None if not a metric."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if _number(v) or (null and v is None):
        return math.nan if v is None else float(v)
    if isinstance(v, (list, tuple)) and all(_number(x) or (null and x is None) for x in v):
        return [math.nan if x is None else float(x) for x in v]
    return None


def finite_values(values: dict) -> tuple[dict, list[str]]:
    """``values`` without ±inf (a list holding one goes too) or lists past MAX_LIST, and the dropped keys."""
    dropped = [k for k, v in values.items() if ((len(v) > MAX_LIST or any(map(math.isinf, v)))
                                                if isinstance(v, list) else math.isinf(v))]
    return {k: v for k, v in values.items() if k not in dropped}, dropped


def record_to_json(rec: MetricRecords) -> bytes:
    """One metrics line (no newline); the envelope fields win over metrics that reuse their names."""
    row = {k: v for k, v in rec.values.items() if k not in _RESERVED}
    return msgspec.json.encode({"step": rec.step, "time": rec.time, "role": rec.role, "id": rec.id, **row})


def bounded_json(line: bytes):
    """``json.loads(line)``; ValueError, unparsed, past MAX_LINE bytes or MAX_DEPTH nested arrays/objects."""
    s = line if len(line) <= MAX_LINE and line.count(b"[") + line.count(b"{") > MAX_DEPTH else b""
    s = re.sub(rb'"[^"]*"', b"", re.sub(rb"\\.", b"", s))  # maybe deep: without strings, then without
    for _ in range(MAX_DEPTH):  # the innermost pairs MAX_DEPTH times, nothing may be left
        s = re.sub(rb"[\[{][^\[\]{}]*[\]}]", b"", s)
    if len(line) > MAX_LINE or b"[" in s or b"{" in s:
        raise ValueError(f"a line of {len(line)} bytes, or nested deeper than {MAX_DEPTH}")
    return json.loads(line)


def regular(path: str) -> bool:
    """Not a directory, FIFO or device (checked before any open: opening a FIFO hangs)."""
    return stat.S_ISREG(os.stat(path).st_mode)


def record_from_json(row) -> MetricRecords:
    """The inverse of :func:`record_to_json`, without non-metric values; ValueError for a bad envelope."""
    if not isinstance(row, dict):
        raise ValueError(f"a metrics line is a JSON object, got {type(row).__name__}")
    step, t, role, id_ = (row.get(k) for k in _RESERVED)
    if not (isinstance(step, int) and not isinstance(step, bool) and _number(t) and math.isfinite(t)
            and isinstance(role, str) and isinstance(id_, str)):
        raise ValueError(f"a metrics line needs int step, finite time, str role and id: {str(row)[:80]}")
    values = {k: x for k, v in row.items() if k not in _RESERVED and (x := _value(v, null=True)) is not None}
    return MetricRecords(role=role, id=id_, step=step, time=float(t), values=values)


def _counters(id: str, counts: dict) -> MetricRecords:
    """The ``monitor/<name>`` record (step -1) of a writer's or the follower's counters."""
    values = {f"monitor/{k}": float(v) for k, v in counts.items()}
    return MetricRecords(role="monitor", id=id, step=-1, time=time.time(), values=values)


def _path_part(name: str) -> str:
    out = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in name)[:64]
    return out if out.strip(".") else "_"


class _Appender:
    """Whole lines appended with one ``os.write`` on ``O_APPEND`` each (a crash tears at most the last
    line). An OSError is logged once and counted in ``errors``; a torn line is ended before the next."""

    def __init__(self, path: str):
        self.path = path
        self.errors = 0
        self._fd: int | None = None
        self._torn = self._failing = False

    def open(self) -> None:
        if self._fd is None:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            size = os.fstat(self._fd).st_size
            self._torn = size > 0 and os.pread(self._fd, 1, size - 1) != b"\n"

    def append(self, data: bytes) -> bool:
        """True when all of ``data`` was written."""
        try:
            self.open()
            self._write(b"\n" + data if self._torn else data)
        except OSError as e:
            self._torn = self._failing = True
            self.errors += 1
            if self.errors == 1:
                log.error("metrics: cannot write %s (%s); the run continues, metrics are not recorded "
                          "there until it can write again", self.path, e.strerror or e)
            return False
        self._torn = False
        if self._failing:
            self._failing = False
            log.warning("metrics: writing %s again (%d writes failed)", self.path, self.errors)
        return True

    def _write(self, data: bytes) -> None:
        if (n := os.write(self._fd, data)) != len(data):  # the disk filled up within it
            raise OSError(f"short write: {n} of {len(data)} bytes")

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class _Closing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MetricsWriter(_Closing):
    """One role's metrics file; its counters, once not zero, follow as a ``monitor``/``<role>-<id>`` record."""

    def __init__(self, run_dir: str, role: str, id: str):
        self.role, self.id = role, id
        self.path = os.path.join(run_dir, METRICS_DIR, f"{_path_part(role)}-{_path_part(id)}.jsonl")
        self.values_dropped = 0
        self._file = _Appender(self.path)
        self._reported = {"values_dropped": 0, "write_errors": 0}
        self._closed = False

    write_errors = property(lambda self: self._file.errors)

    def emit(self, step: int, values: dict) -> None:
        """Append one record; never raises OSError. TypeError for a non-numeric value (a caller bug)."""
        clean = {}
        for k, v in values.items():
            if (value := _value(v, null=False)) is None:
                raise TypeError(f"metric {k!r}: expected a number or a list of numbers, got {v!r:.80}")
            clean[str(k)] = value
        if self._closed:
            return
        clean, dropped = finite_values(clean)
        if dropped and not self.values_dropped:
            log.warning("metrics: an inf or overlong list %r dropped (counted as monitor/values_dropped)", dropped[0])
        self.values_dropped += len(dropped)
        rec = MetricRecords(role=self.role, id=self.id, step=int(step), time=time.time(), values=clean)
        if self._file.append(record_to_json(rec) + b"\n"):
            now = {"values_dropped": self.values_dropped, "write_errors": self.write_errors}
            if now != self._reported:
                self._reported = now
                self._file.append(record_to_json(_counters(f"{self.role}-{self.id}", now)) + b"\n")

    def close(self) -> None:
        self._closed = True
        self._file.close()


class FileTail:
    """The complete lines appended to one JSON-lines file since the last :meth:`read`, decoded. A bad
    line is skipped and counted; a file that shrank or was replaced is read again from its start."""

    def __init__(self, path: str, offset: int = 0, ino: int | None = None):
        self.path, self.offset, self._ino = path, offset, ino
        self.bad_lines = self.values_dropped = self.resets = 0
        self._partial, self._skip = b"", False

    def read(self) -> list[MetricRecords]:
        try:
            if not regular(self.path):  # never read; the readers' commands refuse it (attach.metrics_path)
                return []
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if (self._ino is not None and st.st_ino != self._ino) or st.st_size < self.offset:
                    self.offset, self._partial, self._skip = 0, b"", False
                    self.resets += 1
                self._ino = st.st_ino
                f.seek(self.offset)
                chunk = f.read(READ_CHUNK)
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if self._skip and lines:  # the end of a line too long to keep
            lines[0], self._skip = b"", False
        if len(self._partial) > MAX_LINE:  # dropped as it comes instead of growing without bound; counted once
            self.bad_lines += not self._skip
            self._partial, self._skip = b"", True
        return [r for r in map(self._decode, lines) if r is not None]

    def _decode(self, line: bytes) -> MetricRecords | None:
        if not line.strip():
            return None
        try:
            rec = record_from_json(bounded_json(line))
        except (ValueError, TypeError, OverflowError):  # bad, long or deep JSON, a wrong shape, an int past float
            self.bad_lines += 1
            return None
        values, dropped = finite_values(rec.values)
        self.values_dropped += len(dropped)
        return msgspec.structs.replace(rec, values=values) if dropped else rec

    def caught_up(self) -> bool:
        try:
            return not regular(self.path) or os.path.getsize(self.path) <= self.offset
        except OSError:
            return True


class MetricsFollower(_Closing):
    """Every role file under ``run_dir/metrics/``: :meth:`read` returns what they gained, in time order. Read-only
    unless ``merge`` (the launcher's: appends it, and its counters when they change, to metrics.jsonl)."""

    def __init__(self, run_dir: str, merge: bool = False, tensorboard: TensorBoardWriter | None = None):
        self.dir = os.path.join(run_dir, METRICS_DIR)
        self._tails: dict[str, FileTail] = {}
        self._merged = _Appender(os.path.join(run_dir, MERGED_FILE)) if merge else None
        if self._merged is not None:
            self._merged.open()  # readers expect the file from the start; an unwritable run dir fails here
        self._state_path = os.path.join(run_dir, MERGED_STATE)
        state = read_json(self._state_path) if merge else None  # none valid: every file from its start
        ok = isinstance(state, dict) and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                                             and isinstance(v[1], (int, type(None))) for v in state.values())
        self._state = state if ok else {}
        self._tb = tensorboard
        self._state_errors = self.tensorboard_errors = 0
        self._reported = {"bad_lines": 0, "values_dropped": 0, "write_errors": 0}

    bad_lines = property(lambda self: sum(t.bad_lines for t in self._tails.values()))
    values_dropped = property(lambda self: sum(t.values_dropped for t in self._tails.values()))
    resets = property(lambda self: sum(t.resets for t in self._tails.values()))
    write_errors = property(lambda self: self._merged.errors + self._state_errors if self._merged else 0)

    def read(self) -> list[MetricRecords]:
        """Never raises for a bad line or a failed write: both are counted."""
        with contextlib.suppress(OSError):  # no directory (yet): no files
            for name in sorted(n for n in os.listdir(self.dir) if n.endswith(".jsonl") and n not in self._tails):
                self._tails[name] = FileTail(os.path.join(self.dir, name), *self._state.get(name, (0, None)))
        out = sorted((r for tail in self._tails.values() for r in tail.read()), key=lambda r: r.time)
        if self._merged is not None:
            now = {"bad_lines": self.bad_lines, "values_dropped": self.values_dropped,
                   "write_errors": self.write_errors}
            if now != self._reported:
                self._reported = now
                out.append(_counters("follower", now))
            if out:
                self._merged.append(b"".join(record_to_json(r) + b"\n" for r in out))
            self._save_state()
        if self._tb is not None and out:
            try:
                self._tb.write(out)
            except Exception as e:  # noqa: BLE001 -- an OSError, or tensorboardX's own: never fatal
                self.tensorboard_errors += 1
                if self.tensorboard_errors == 1:
                    log.error("metrics: cannot write TensorBoard events under %s (%s); the run continues",
                              self._tb.root, e)
        return out

    def _save_state(self) -> None:
        # per file [bytes of complete lines read, inode]: where the next reader starts
        state = {name: [t.offset - len(t._partial), t._ino] for name, t in self._tails.items()}
        if state == self._state:
            return
        try:
            atomic_write(self._state_path, json.dumps(state).encode(), durable=False, mode=0o600)
            self._state = state
        except OSError as e:
            self._state_errors += 1
            if self._state_errors == 1:
                log.error("metrics: cannot write %s (%s); the run continues", self._state_path, e.strerror or e)

    def caught_up(self) -> bool:
        return all(t.caught_up() for t in self._tails.values())

    def close(self) -> None:
        if self._tb is not None:
            with contextlib.suppress(Exception):  # as in read: never fatal
                self._tb.close()
            self._tb = None
        if self._merged is not None:
            self._merged.close()


def read_all(follower) -> list[MetricRecords]:
    out = follower.read()
    while not follower.caught_up():
        out += follower.read()
    return out


def follower_for(cfg, run_dir: str) -> MetricsFollower:
    """The launcher's follower: merges into metrics.jsonl, and TensorBoard with ``metrics.tensorboard``."""
    tb = TensorBoardWriter(run_dir) if cfg.metrics.tensorboard else None  # opens no file yet
    return MetricsFollower(run_dir, merge=True, tensorboard=tb)


def merge_pending(run_dir: str) -> None:
    """Merge what the role files gained since the last merge (the final eval, after the launcher)."""
    with MetricsFollower(run_dir, merge=True) as follower:
        read_all(follower)


class TensorBoardWriter:
    """Every finite scalar as an event under ``tensorboard/<role>/<id>/``; a step -1 record goes at the
    latest learner step. Lists are not written (``staleness/hist`` is counts, not a distribution)."""

    def __init__(self, run_dir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("`$.metrics.tensorboard` = true needs tensorboardX: "
                              "pip install -e '.[tensorboard]'") from None
        self._make = SummaryWriter
        self.root = os.path.join(run_dir, "tensorboard")
        self._writers: dict[str, object] = {}  # by logdir
        self.learner_step = 0

    def write(self, records: list[MetricRecords]) -> None:
        for rec in records:
            if rec.role == "learner" and rec.step >= 0:
                self.learner_step = rec.step
            step = rec.step if rec.step >= 0 else self.learner_step
            logdir = os.path.join(self.root, _path_part(rec.role), _path_part(rec.id))
            if logdir not in self._writers:
                self._writers[logdir] = self._make(logdir=logdir, flush_secs=5)
            for k, v in rec.values.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._writers[logdir].add_scalar(k, v, global_step=step, walltime=rec.time)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
