"""Metrics as files: every role process appends its MetricRecords to its own JSON-lines file,
``run_dir/metrics/<role>-<id>.jsonl``; one follower in the launcher tails them all, feeds the
live view, and merges them into ``run_dir/metrics.jsonl`` (and TensorBoard event files).

Why files and not a socket: the run directory is already the one place every role shares
(config, secret, checkpoints, spool, weights; the same path on every Ray node), so metrics need
no port, no handshake, no secret, no CURVE, and put no rule on where a role runs. A role never
waits for anyone: what it writes before the launcher looks is still there (no "slow joiner"),
a slow or absent launcher costs it nothing, and ``run.py monitor`` follows the very same files,
read-only. Trust is the directory's: it is 0700 and each file 0600 (the roles' umask 077).

Writing (:class:`MetricsWriter`, one per role process and file): one line per record, written
with one ``os.write`` on an ``O_APPEND`` descriptor (nothing buffered), so a crash tears at most
the last line; a restarted role appends to its file, first ending a line its predecessor tore.
A failed write (a full disk, any OSError) never leaves the writer: it is logged once, naming the
file, counted, and the run goes on; that record is lost, and writing resumes with the disk.

Values are metric names (ARCHITECTURE.md: Metric vocabulary) mapped to a float or a list of
floats. NaN means "no value this interval" (a p99 of no samples): it is kept and written as JSON
``null``. ±inf never is a measurement (an overflow), so the writer drops such a value (a list
holding one too) and counts it. A writer's counters, once one is not zero, follow its records
in its own file as a ``monitor``/``<role>-<id>`` record (``monitor/values_dropped``,
``monitor/write_errors``).

Reading (:class:`FileTail` per file, :class:`MetricsFollower` for ``run_dir/metrics/``, where
files appear as roles start): complete lines only -- a torn last line is kept until its newline
arrives, and read once. A line that is not a record, or has a non-finite time, is skipped and
counted (``monitor/bad_lines``); ±inf in one (a hand-written ``Infinity``) is dropped and
counted. A file that shrank or was replaced is read again from its start, and counted.

Merging (the launcher's follower, :func:`follower_for`): each read's records, in time order,
are appended to metrics.jsonl -- the file every reader uses (plots, sweeps, benches, tests) --
with the follower's own counters as a ``monitor``/``follower`` record when one changed. How far
each role file was merged is kept in ``run_dir/metrics.merged.json``, so the next launcher (a
resume) and the final eval (:func:`merge_pending`, after the launcher) merge only what is new;
a crash between an append and that note merges those lines twice, never loses them. A failed
write of either is logged once, counted (``monitor/write_errors``), and the run goes on.

TensorBoard (``metrics.tensorboard = true``, extra ``tensorboard``): the launcher's follower
also writes every finite scalar of every record to event files under
``run_dir/tensorboard/<role>/<id>/`` (:class:`TensorBoardWriter`), under the same metric names
as metrics.jsonl; one TensorBoard run per source, so two actors' ``actor/tokens_per_s`` stay two
curves, as they are two lines in the JSONL. The step is the record's; a launcher record (step -1: ``run/restarts/<role>``) is placed at
the latest learner step the follower has seen, which is the learner step at that wall-clock time.
The record's time is the event's wall time. NaN ("no value") and list values (``staleness/hist``)
are not written: a TensorBoard histogram is a distribution of values, not counts by index, and
would mislabel it. tensorboardX imports torch when torch is installed (``tensorboardX/writer.py``);
the launcher has it loaded already (the start-up contract check).

None of these classes is thread-safe: one writer per thread and file.
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
READ_CHUNK = 8 << 20  # bytes per read of one file: a big backlog comes in slices
MAX_LINE = 4 << 20  # a record is a few KB; a "line" this long is garbage
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
    """One metrics line (without newline). NaN/inf become null (msgspec's JSON rule);
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


def _path_part(name: str) -> str:
    """A role or id as one file or directory name (they are short identifiers; anything else is made so)."""
    out = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in name)[:64]
    return out if out.strip(".") else "_"


def role_path(run_dir: str, role: str, id: str) -> str:
    """The file a role's records are appended to."""
    return os.path.join(run_dir, METRICS_DIR, f"{_path_part(role)}-{_path_part(id)}.jsonl")


# ---- writing ----------------------------------------------------------------------------------


def _ends_torn(fd: int) -> bool:
    """True when the file's last byte is not a newline (a writer died in the middle of a line)."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


class _Appender:
    """Whole lines appended to one file, one ``os.write`` each; never raises for an OSError
    (logged once, counted in ``errors``). A line a failure may have torn is ended before the next."""

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
            self._torn = _ends_torn(self._fd)

    def append(self, data: bytes) -> bool:
        """True when all of ``data`` was written."""
        try:
            self.open()
            self._write(b"\n" + data if self._torn else data)
        except OSError as e:
            self._failed(e)
            return False
        if self._failing:
            self._failing = False
            log.warning("metrics: writing %s again (%d writes failed)", self.path, self.errors)
        return True

    def _write(self, data: bytes) -> None:
        n = os.write(self._fd, data)
        if n != len(data):  # a short write: the disk filled up within it
            raise OSError(f"short write: {n} of {len(data)} bytes")
        self._torn = False

    def _failed(self, e: OSError) -> None:
        self._torn = True  # the failed write may have left part of a line
        self._failing = True
        self.errors += 1
        if self.errors == 1:
            log.error("metrics: cannot write %s (%s); the run continues, metrics are not recorded "
                      "there until it can write again", self.path, e.strerror or e)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class MetricsWriter:
    """One role process's metrics: each :meth:`emit` appends one line to
    ``run_dir/metrics/<role>-<id>.jsonl`` (created on the first)."""

    def __init__(self, run_dir: str, role: str, id: str):
        self.role, self.id = role, id
        self.path = role_path(run_dir, role, id)
        self.written = 0
        self.values_dropped = 0  # ±inf values left out
        self._file = _Appender(self.path)
        self._reported = (0, 0)
        self._closed = False

    @property
    def write_errors(self) -> int:
        """Records that could not be written (each one write)."""
        return self._file.errors

    def emit(self, step: int, values: dict) -> None:
        """Append one record; never blocks on another process and never raises OSError. Raises
        TypeError only for a value that is not a number or a list of numbers (a caller bug,
        reported where it happens)."""
        clean = {str(k): _as_value(k, v) for k, v in values.items()}
        if self._closed:
            return
        clean, dropped = finite_values(clean)
        self._note_dropped(dropped)
        rec = MetricRecords(role=self.role, id=self.id, step=int(step), time=time.time(), values=clean)
        if self._file.append(record_to_json(rec) + b"\n"):
            self.written += 1
            self._report()

    def _note_dropped(self, dropped: list[str]) -> None:
        if dropped and not self.values_dropped:
            log.warning("metrics: an infinite value of %r dropped (counted as monitor/values_dropped)",
                        dropped[0])
        self.values_dropped += len(dropped)

    def _report(self) -> None:
        """The writer's counters as a record of their own, when one changed since the last."""
        now = (self.values_dropped, self.write_errors)
        if now == self._reported:
            return
        self._reported = now
        values = {"monitor/values_dropped": float(now[0]), "monitor/write_errors": float(now[1])}
        rec = MetricRecords(role="monitor", id=f"{self.role}-{self.id}", step=-1, time=time.time(), values=values)
        self._file.append(record_to_json(rec) + b"\n")

    def close(self) -> None:
        self._closed = True
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- reading ----------------------------------------------------------------------------------


def parse_line(line: bytes) -> tuple[MetricRecords | None, int]:
    """The record of one line (None: not a record, or a non-finite time) and how many ±inf
    values were left out of it."""
    try:
        rec = record_from_json(json.loads(line))
    except (ValueError, TypeError):  # JSONDecodeError, UnicodeDecodeError, a wrong shape
        return None, 0
    if not math.isfinite(rec.time):
        return None, 0
    values, dropped = finite_values(rec.values)
    return (msgspec.structs.replace(rec, values=values) if dropped else rec), len(dropped)


class FileTail:
    """The records appended to one JSON-lines file since the last :meth:`read` (complete lines
    only). ``offset``/``ino``: where an earlier reader of the same file stopped."""

    def __init__(self, path: str, offset: int = 0, ino: int | None = None):
        self.path = path
        self.offset = offset
        self.bad_lines = 0  # lines that were not a metrics record
        self.values_dropped = 0  # ±inf values left out of records
        self.resets = 0  # times the file shrank or was replaced and was read from its start
        self._partial = b""
        self._ino = ino

    def read(self) -> list[MetricRecords]:
        """Every complete new line, decoded; [] while the file does not exist."""
        chunk = self._read_bytes()
        if not chunk:
            return []
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:  # never a line: drop it instead of growing without bound
            self._partial = b""
            self.bad_lines += 1
        return [r for r in map(self._decode, lines) if r is not None]

    def _read_bytes(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                self._check_reset(os.fstat(f.fileno()))
                f.seek(self.offset)
                chunk = f.read(READ_CHUNK)
        except FileNotFoundError:
            return b""
        self.offset += len(chunk)
        return chunk

    def _check_reset(self, st: os.stat_result) -> None:
        replaced = self._ino is not None and st.st_ino != self._ino
        if replaced or st.st_size < self.offset:
            self.offset, self._partial = 0, b""
            self.resets += 1
        self._ino = st.st_ino

    def _decode(self, line: bytes) -> MetricRecords | None:
        if not line.strip():
            return None
        rec, dropped = parse_line(line)
        self.bad_lines += rec is None
        self.values_dropped += dropped
        return rec

    def caught_up(self) -> bool:
        """True when the last read reached the end of the file (nothing backlogged)."""
        try:
            return os.path.getsize(self.path) <= self.offset
        except OSError:
            return True

    def done(self) -> list:
        """``[bytes of complete lines read, inode]``: where the next reader starts."""
        return [self.offset - len(self._partial), self._ino]


class _MergedLog:
    """``metrics.jsonl`` and, in ``metrics.merged.json``, how far each role file went into it."""

    def __init__(self, run_dir: str):
        self._file = _Appender(os.path.join(run_dir, MERGED_FILE))
        self._file.open()  # the readers expect the file from the start; an unwritable run dir fails here
        self.state_path = os.path.join(run_dir, MERGED_STATE)
        self.state = self._load()
        self.state_errors = 0

    @property
    def errors(self) -> int:
        return self._file.errors + self.state_errors

    def _load(self) -> dict[str, list]:
        """The saved state; {} without a valid one (every role file is then merged from its start)."""
        try:
            with open(self.state_path, "rb") as f:
                state = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        ok = isinstance(state, dict) and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                                             and isinstance(v[1], (int, type(None))) for v in state.values())
        return state if ok else {}

    def start(self, name: str) -> tuple[int, int | None]:
        """Where to start reading the role file ``name``: after what was merged of it."""
        offset, ino = self.state.get(name, (0, None))
        return offset, ino

    def append(self, records: list[MetricRecords], tails: dict[str, FileTail]) -> None:
        if records:
            self._file.append(b"".join(record_to_json(r) + b"\n" for r in records))
        state = {name: t.done() for name, t in tails.items()}
        if state != self.state:
            self._save(state)

    def _save(self, state: dict) -> None:
        try:
            atomic_write(self.state_path, json.dumps(state).encode(), durable=False, mode=0o600)
        except OSError as e:
            self.state_errors += 1
            if self.state_errors == 1:
                log.error("metrics: cannot write %s (%s); the run continues", self.state_path, e.strerror or e)
            return
        self.state = state

    def close(self) -> None:
        self._file.close()


class MetricsFollower:
    """Every role's file under ``run_dir/metrics/``: :meth:`read` returns what was appended to
    any of them since the last read, in time order. Read-only unless ``merge`` (the launcher's:
    module docstring); ``tensorboard``: a :class:`TensorBoardWriter` also fed (closed with it)."""

    def __init__(self, run_dir: str, merge: bool = False, tensorboard: TensorBoardWriter | None = None):
        self.dir = os.path.join(run_dir, METRICS_DIR)
        self._tails: dict[str, FileTail] = {}
        self._merged = _MergedLog(run_dir) if merge else None
        self._tb = tensorboard
        self.tensorboard_errors = 0
        self._reported = (0, 0, 0)

    bad_lines = property(lambda self: sum(t.bad_lines for t in self._tails.values()))
    values_dropped = property(lambda self: sum(t.values_dropped for t in self._tails.values()))
    resets = property(lambda self: sum(t.resets for t in self._tails.values()))
    write_errors = property(lambda self: self._merged.errors if self._merged else 0)

    def read(self) -> list[MetricRecords]:
        """What every role file gained since the last read (the merging follower also appends it,
        with its counters, to metrics.jsonl, and to TensorBoard). Never raises for a bad line or
        a failed write: both are counted."""
        out = [r for tail in self._scan() for r in tail.read()]
        out.sort(key=lambda r: r.time)
        if self._merged is not None:
            out += self._counters()
            self._merged.append(out, self._tails)
        self._to_tensorboard(out)
        return out

    def _scan(self) -> list[FileTail]:
        """The tails of every ``*.jsonl`` in the directory, a new one for each file that appeared."""
        with contextlib.suppress(OSError):  # no directory (yet): no files
            for name in sorted(n for n in os.listdir(self.dir) if n.endswith(".jsonl")):
                if name not in self._tails:
                    start = self._merged.start(name) if self._merged is not None else (0, None)
                    self._tails[name] = FileTail(os.path.join(self.dir, name), *start)
        return list(self._tails.values())

    def caught_up(self) -> bool:
        """True when the last read reached the end of every file."""
        return all(t.caught_up() for t in self._tails.values())

    def _counters(self) -> list[MetricRecords]:
        """A record of the follower's own counters, when one changed since the last."""
        now = (self.bad_lines, self.values_dropped, self.write_errors)
        if now == self._reported:
            return []
        self._reported = now
        names = ("bad_lines", "values_dropped", "write_errors")
        values = {f"monitor/{n}": float(v) for n, v in zip(names, now)}
        return [MetricRecords(role="monitor", id="follower", step=-1, time=time.time(), values=values)]

    def _to_tensorboard(self, records: list[MetricRecords]) -> None:
        """As for metrics.jsonl: a failure is logged once, counted, and the run goes on."""
        if self._tb is None or not records:
            return
        try:
            self._tb.write(records)
        except Exception as e:  # noqa: BLE001 -- an OSError, or tensorboardX's own
            self.tensorboard_errors += 1
            if self.tensorboard_errors == 1:
                log.error("metrics: cannot write TensorBoard events under %s (%s); the run continues",
                          self._tb.root, e)

    def close(self) -> None:
        if self._tb is not None:
            with contextlib.suppress(Exception):  # as in _to_tensorboard: never fatal
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
    tb = TensorBoardWriter(run_dir) if cfg.metrics.tensorboard else None
    try:
        return MetricsFollower(run_dir, merge=True, tensorboard=tb)
    except BaseException:
        if tb is not None:
            tb.close()
        raise


def merge_pending(run_dir: str) -> None:
    """Merge into metrics.jsonl what the role files gained since the last merge (after the
    launcher has stopped: the final eval)."""
    with MetricsFollower(run_dir, merge=True) as follower:
        read_all(follower)


# ---- TensorBoard ------------------------------------------------------------------------------

TENSORBOARD_DIR = "tensorboard"


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
