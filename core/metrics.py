"""Metrics as files: each role process appends its MetricRecords to its own JSON-lines file,
``run_dir/metrics/<role>-<id>.jsonl``; one follower in the launcher tails them all, feeds the live
view and merges them into ``run_dir/metrics.jsonl`` (and TensorBoard). Why files, and the failure
rules, are in ARCHITECTURE.md (Metric vocabulary). Values are a float or a list of floats: NaN is
"no value" (JSON null); ±inf is an overflow, never a measurement, so it is dropped and counted on
write and on read. ``metrics.merged.json`` notes how far each role file was merged, so a resume or
the final eval merges only what is new (a crash between the two merges lines twice, never loses
them). None of these classes is thread-safe: one writer per thread and file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from numbers import Real

import msgspec

from core.files import atomic_write
from core.messages import MetricRecords

METRICS_DIR = "metrics"  # run_dir/metrics/<role>-<id>.jsonl: one writer each
MERGED_FILE = "metrics.jsonl"  # every role's records, merged by the launcher
MERGED_STATE = "metrics.merged.json"  # role file name -> [bytes merged, inode]
TENSORBOARD_DIR = "tensorboard"
READ_CHUNK = 8 << 20  # bytes per read of one file: a big backlog comes in slices
MAX_LINE = 4 << 20  # a record is a few KB; a "line" this long is garbage
_RESERVED = ("step", "time", "role", "id")

log = logging.getLogger(__name__)


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _as_value(key: str, v) -> float | list[float]:
    # numpy scalars/arrays are coerced here so the encoder never sees a foreign type
    if hasattr(v, "tolist"):
        v = v.tolist()
    if _number(v):
        return float(v)
    if isinstance(v, (list, tuple)) and all(map(_number, v)):
        return [float(x) for x in v]
    raise TypeError(f"metric {key!r}: expected a number or a list of numbers, got {v!r:.80}")


def finite_values(values: dict) -> tuple[dict, list[str]]:
    """``values`` without ±inf (a list holding one goes too), and the dropped keys."""
    keep, dropped = {}, []
    for k, v in values.items():
        if any(map(math.isinf, v)) if isinstance(v, list) else math.isinf(v):
            dropped.append(k)
        else:
            keep[k] = v
    return keep, dropped


def record_to_json(rec: MetricRecords) -> bytes:
    """One metrics line (no newline); the envelope fields win over metrics that reuse their names."""
    row = {k: v for k, v in rec.values.items() if k not in _RESERVED}
    return msgspec.json.encode({"step": rec.step, "time": rec.time, "role": rec.role, "id": rec.id, **row})


def _json_value(v) -> float | list[float] | None:
    """null (a NaN on write) is NaN again; None if not a metric."""
    if v is None or _number(v):
        return math.nan if v is None else float(v)
    if isinstance(v, list) and all(x is None or _number(x) for x in v):
        return [math.nan if x is None else float(x) for x in v]
    return None


def record_from_json(row) -> MetricRecords:
    """The inverse of :func:`record_to_json` (``row`` parsed), leaving out values that are not
    metrics; ValueError for a row without a valid envelope."""
    if not isinstance(row, dict):
        raise ValueError(f"a metrics line is a JSON object, got {type(row).__name__}")
    step, t, role, id_ = (row.get(k) for k in _RESERVED)
    if not (isinstance(step, int) and not isinstance(step, bool) and _number(t)
            and isinstance(role, str) and isinstance(id_, str)):
        raise ValueError(f"a metrics line needs int step, number time, str role and id: {str(row)[:80]}")
    values = {k: _json_value(v) for k, v in row.items() if k not in _RESERVED}
    return MetricRecords(role=role, id=id_, step=step, time=float(t),
                         values={k: v for k, v in values.items() if v is not None})


def _path_part(name: str) -> str:
    """A role or id as one file or directory name."""
    out = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in name)[:64]
    return out if out.strip(".") else "_"


def role_path(run_dir: str, role: str, id: str) -> str:
    return os.path.join(run_dir, METRICS_DIR, f"{_path_part(role)}-{_path_part(id)}.jsonl")


class _Appender:
    """Whole lines appended to one file, one ``os.write`` on ``O_APPEND`` each (a crash tears at most
    the last line). An OSError never leaves it: logged once, counted in ``errors``, and the line
    a failure (or a dead predecessor) may have torn is ended before the next."""

    def __init__(self, path: str):
        self.path = path
        self.errors = 0
        self._fd: int | None = None
        self._torn = False
        self._failing = False

    def open(self) -> None:
        """Open (create) the file now; raises OSError."""
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
        n = os.write(self._fd, data)
        if n != len(data):  # the disk filled up within it
            raise OSError(f"short write: {n} of {len(data)} bytes")

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class MetricsWriter:
    """One role process's metrics file. Its counters, once one is not zero, follow its records as a
    ``monitor``/``<role>-<id>`` record (``monitor/values_dropped``, ``monitor/write_errors``)."""

    def __init__(self, run_dir: str, role: str, id: str):
        self.role, self.id = role, id
        self.path = role_path(run_dir, role, id)
        self.written = self.values_dropped = 0  # records written, ±inf values left out
        self._file = _Appender(self.path)
        self._reported = (0, 0)
        self._closed = False

    @property
    def write_errors(self) -> int:
        return self._file.errors

    def emit(self, step: int, values: dict) -> None:
        """Append one record; never blocks and never raises OSError. TypeError for a value that is
        not a number or a list of numbers (a caller bug, reported where it happens)."""
        clean = {str(k): _as_value(k, v) for k, v in values.items()}
        if self._closed:
            return
        clean, dropped = finite_values(clean)
        if dropped and not self.values_dropped:
            log.warning("metrics: an infinite value of %r dropped (counted as monitor/values_dropped)",
                        dropped[0])
        self.values_dropped += len(dropped)
        if self._append(self.role, self.id, int(step), clean):
            self.written += 1
            now = (self.values_dropped, self.write_errors)
            if now != self._reported:
                self._reported = now
                self._append("monitor", f"{self.role}-{self.id}", -1, {
                    "monitor/values_dropped": float(now[0]), "monitor/write_errors": float(now[1])})

    def _append(self, role: str, id: str, step: int, values: dict) -> bool:
        rec = MetricRecords(role=role, id=id, step=step, time=time.time(), values=values)
        return self._file.append(record_to_json(rec) + b"\n")

    def close(self) -> None:
        self._closed = True
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class FileTail:
    """The records appended to one JSON-lines file since the last :meth:`read`, complete lines only
    (a torn last line is kept until its newline arrives). A line that is not a record, or has a
    non-finite time, is skipped and counted; a file that shrank or was replaced is read again from
    its start. ``offset``/``ino``: where an earlier reader of the same file stopped."""

    def __init__(self, path: str, offset: int = 0, ino: int | None = None):
        self.path = path
        self.offset = offset
        self.bad_lines = self.values_dropped = self.resets = 0  # values_dropped: ±inf left out
        self._partial = b""
        self._ino = ino

    def read(self) -> list[MetricRecords]:
        """Every complete new line, decoded; [] while the file does not exist."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if (self._ino is not None and st.st_ino != self._ino) or st.st_size < self.offset:
                    self.offset, self._partial = 0, b""
                    self.resets += 1
                self._ino = st.st_ino
                f.seek(self.offset)
                chunk = f.read(READ_CHUNK)
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        if not chunk:
            return []
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:  # never a line: drop it instead of growing without bound
            self._partial = b""
            self.bad_lines += 1
        return [r for r in map(self._decode, lines) if r is not None]

    def _decode(self, line: bytes) -> MetricRecords | None:
        if not line.strip():
            return None
        try:
            rec = record_from_json(json.loads(line))
        except (ValueError, TypeError):  # JSONDecodeError, UnicodeDecodeError, a wrong shape
            rec = None
        if rec is None or not math.isfinite(rec.time):
            self.bad_lines += 1
            return None
        values, dropped = finite_values(rec.values)
        self.values_dropped += len(dropped)
        return msgspec.structs.replace(rec, values=values) if dropped else rec

    def caught_up(self) -> bool:
        """True when the last read reached the end of the file (nothing backlogged)."""
        try:
            return os.path.getsize(self.path) <= self.offset
        except OSError:
            return True

    def done(self) -> list:
        """``[bytes of complete lines read, inode]``: where the next reader starts."""
        return [self.offset - len(self._partial), self._ino]


class MetricsFollower:
    """Every role's file under ``run_dir/metrics/`` (files appear as roles start): :meth:`read`
    returns what any of them gained since the last read, in time order. Read-only unless ``merge``
    (the launcher's, which appends it and its own counters, as a ``monitor``/``follower`` record
    when one changed, to metrics.jsonl); ``tensorboard``: a :class:`TensorBoardWriter` also fed."""

    def __init__(self, run_dir: str, merge: bool = False, tensorboard: TensorBoardWriter | None = None):
        self.dir = os.path.join(run_dir, METRICS_DIR)
        self._tails: dict[str, FileTail] = {}
        self._merged = _Appender(os.path.join(run_dir, MERGED_FILE)) if merge else None
        if self._merged is not None:
            self._merged.open()  # readers expect the file from the start; an unwritable run dir fails here
        self._state_path = os.path.join(run_dir, MERGED_STATE)
        self._state = self._load_state() if merge else {}  # role file name -> [bytes merged, inode]
        self._state_errors = 0
        self._tb = tensorboard
        self.tensorboard_errors = 0
        self._reported = (0, 0, 0)

    bad_lines = property(lambda self: sum(t.bad_lines for t in self._tails.values()))
    values_dropped = property(lambda self: sum(t.values_dropped for t in self._tails.values()))
    resets = property(lambda self: sum(t.resets for t in self._tails.values()))
    write_errors = property(lambda self: self._merged.errors + self._state_errors if self._merged else 0)

    def _load_state(self) -> dict[str, list]:
        """The saved state; {} without a valid one (every role file is then merged from its start)."""
        try:
            with open(self._state_path, "rb") as f:
                state = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        ok = isinstance(state, dict) and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                                             and isinstance(v[1], (int, type(None))) for v in state.values())
        return state if ok else {}

    def read(self) -> list[MetricRecords]:
        """Never raises for a bad line or a failed write: both are counted."""
        with contextlib.suppress(OSError):  # no directory (yet): no files
            for name in sorted(n for n in os.listdir(self.dir) if n.endswith(".jsonl")):
                if name not in self._tails:
                    start = self._state.get(name, (0, None))
                    self._tails[name] = FileTail(os.path.join(self.dir, name), *start)
        out = sorted((r for tail in self._tails.values() for r in tail.read()), key=lambda r: r.time)
        if self._merged is not None:
            now = (self.bad_lines, self.values_dropped, self.write_errors)
            if now != self._reported:
                self._reported = now
                values = dict(zip(("monitor/bad_lines", "monitor/values_dropped", "monitor/write_errors"),
                                  map(float, now)))
                out.append(MetricRecords(role="monitor", id="follower", step=-1, time=time.time(),
                                         values=values))
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
        state = {name: t.done() for name, t in self._tails.items()}
        if state == self._state:
            return
        try:
            atomic_write(self._state_path, json.dumps(state).encode(), durable=False, mode=0o600)
        except OSError as e:
            self._state_errors += 1
            if self._state_errors == 1:
                log.error("metrics: cannot write %s (%s); the run continues", self._state_path,
                          e.strerror or e)
            return
        self._state = state

    def caught_up(self) -> bool:
        """True when the last read reached the end of every file."""
        return all(t.caught_up() for t in self._tails.values())

    def close(self) -> None:
        if self._tb is not None:
            with contextlib.suppress(Exception):  # as in read: never fatal
                self._tb.close()
            self._tb = None
        if self._merged is not None:
            self._merged.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_all(follower) -> list[MetricRecords]:
    """Read ``follower`` (a :class:`MetricsFollower` or :class:`FileTail`) to the end of its files."""
    out = follower.read()
    while not follower.caught_up():
        out += follower.read()
    return out


def follower_for(cfg, run_dir: str) -> MetricsFollower:
    """The launcher's follower: merges into metrics.jsonl and, with ``metrics.tensorboard``,
    writes TensorBoard event files (ConfigError without the package, before any file is opened)."""
    tb = TensorBoardWriter(run_dir) if cfg.metrics.tensorboard else None  # opens no file yet
    return MetricsFollower(run_dir, merge=True, tensorboard=tb)


def merge_pending(run_dir: str) -> None:
    """Merge what the role files gained since the last merge (after the launcher: the final eval)."""
    with MetricsFollower(run_dir, merge=True) as follower:
        read_all(follower)


class TensorBoardWriter:
    """Every finite scalar as an event under ``tensorboard/<role>/<id>/`` (one TensorBoard run per
    source, as in the JSONL), at the record's step and time; a launcher record (step -1) goes at
    the latest learner step seen, the learner's step at that time. NaN and lists are not written:
    a TensorBoard histogram is a distribution, not ``staleness/hist``'s counts by index.
    tensorboardX imports torch when installed; the launcher has it loaded already."""

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
        self.learner_step = 0

    def write(self, records: list[MetricRecords]) -> None:
        for rec in records:
            if rec.role == "learner" and rec.step >= 0:
                self.learner_step = rec.step
            step = rec.step if rec.step >= 0 else self.learner_step
            key = (rec.role, rec.id)
            if key not in self._writers:
                logdir = os.path.join(self.root, _path_part(rec.role), _path_part(rec.id))
                self._writers[key] = self._make(logdir=logdir, flush_secs=5)
            for k, v in rec.values.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._writers[key].add_scalar(k, v, global_step=step, walltime=rec.time)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
