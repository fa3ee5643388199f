"""The live terminal view of a run.

``Monitor`` is fed the MetricRecords the launcher's :class:`core.metrics.MetricsFollower`
reads from the roles' metrics files, keeps the latest value of every metric (the names of ARCHITECTURE.md)
plus a short history, and shows them either as a rich ``Live`` dashboard (a TTY, or
``monitor.live = "on"``) or as one plain line at most every ``monitor.plain_every_s`` seconds
(pipes, CI logs, ``monitor.live = "off"``).

It only reads what roles report: a metric nobody has sent yet is shown as "–", so the view works
for partial runs (buffer only, learner without actors) and never invents a number.

It never raises on what a role sends: NaN, ±inf, 1e308, negative counts and lists holding any
of them are shown as such ("nan", "inf", "1.0e+308") or skipped where they cannot be drawn
(sparklines, bars); a value of the wrong type is dropped and counted (``monitor/values_dropped``).
As a last line of defence a render that fails anyway is logged once and counted
(``render_errors``): the view is not worth stopping a training run for.

The learner's control (``learner/control.py``) is shown as its staleness limit
(``control/max_staleness``, "paused" while the actors are) and the last guard that fired: the
guard and action whose ``control/guard/<name>`` / ``control/action/<action>`` counter last went
up, with the value and threshold that made it fire (metrics carry numbers only, so the reason is
rebuilt from them).

Restarts: the launcher counts every restart of a role as ``run/restarts/<role>`` (step -1); the
view shows their sum and the last one (the role whose counter last went up, and how long ago by
the record's wall-clock time). ``note`` is a one-line status an embedding command sets (``run.py
monitor``: "attached", "the job has ended"); shown in the header.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from core.messages import MetricRecords

HISTORY = 60  # points kept per sparkline metric
SPARK_KEYS = ("eval/reward", "reward/mean", "length/mean", "ratio/p99")
_SPARK = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▏▎▍▌▋▊▉"
MAX_STALENESS_ROWS = 8
BY_STALENESS = "ratio/p99_by_staleness/"
RESTARTS = "run/restarts/"
MAX_VERSION = 2**53  # larger (or non-integral floats) cannot be a policy version

log = logging.getLogger(__name__)

# (green below, yellow below, else red) for metrics where larger is worse
THRESHOLDS = {
    "ratio/p99": (1.1, 1.5),
    "ratio/max": (2.0, 10.0),
    "ratio/clip_frac": (0.01, 0.05),
    "mismatch/kl_k3": (1e-3, 1e-2),
    "learner/idle_frac": (0.2, 0.5),
}


# ---- formatting -----------------------------------------------------------------------------


def _missing(v) -> bool:
    return v is None or isinstance(v, list)


def fmt(v, digits: int = 3) -> str:
    """Compact number: '–' missing, 'nan', 12.3k for large, 1.2e-04 for tiny."""
    if _missing(v):
        return "–"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    a = abs(v)
    if a >= 1e15:
        return f"{v:.1e}"
    if a >= 1e6:
        return f"{v / 1e6:.1f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100:
        return f"{v:.0f}"
    if digits > 0 and 0 < a < 10 ** -digits:
        return f"{v:.1e}"
    return f"{v:.{digits}f}"


def fmt_duration(s: float) -> str:
    if not 0 <= s < 1e7:  # negative, NaN, inf, or more than ~115 days
        return fmt(s, 1) + "s"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def grade(key: str, v) -> str:
    """rich style for a value against THRESHOLDS (green/yellow/red); '' if ungraded."""
    if key not in THRESHOLDS or _missing(v):
        return ""
    if math.isnan(v):
        return "bold red"
    good, warn = THRESHOLDS[key]
    return "green" if v < good else "yellow" if v < warn else "bold red"


def sparkline(values, width: int = 12) -> str:
    pts = [v for v in list(values)[-width:] if math.isfinite(v)]
    if len(pts) < 2:
        return ""
    # halved, so that hi - lo cannot overflow to inf for values near the float limit
    lo, hi = min(pts) / 2, max(pts) / 2
    span = hi - lo or 1.0
    return "".join(_SPARK[min(7, int((v / 2 - lo) / span * 7.999))] for v in pts)


def bar(frac: float, width: int) -> str:
    frac = min(max(frac, 0.0), 1.0) if frac == frac else 0.0  # NaN draws nothing
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[part] if part else "")).ljust(width)


# ---- the monitor ------------------------------------------------------------------------------


class Monitor:
    def __init__(self, cfg, console: Console | None = None, live: bool | None = None):
        self.console = console if console is not None else Console()
        mode = cfg.monitor.live
        if live is None:
            live = mode == "on" or (mode == "auto" and self.console.is_terminal)
        self.live = live
        self.refresh_s = cfg.monitor.refresh_s
        self.plain_every_s = cfg.monitor.plain_every_s
        self.max_steps = cfg.run.max_steps
        self.max_time_s = cfg.run.max_time_s
        self.stage = cfg.run.stage  # a pipeline's stage (pipeline.py): leads the step counter
        self.start_time = time.time()
        self.records = 0
        self.latest: dict[str, float | list[float]] = {}
        self._by_source: dict[str, dict[str, float | list[float]]] = {}  # "role/id" -> values
        self._history = {k: deque(maxlen=HISTORY) for k in SPARK_KEYS}
        self.eval_first: float | None = None
        self.eval_best: float | None = None
        self._last_render = -math.inf
        self._last_line = -math.inf
        self._dirty = False
        self._live: Live | None = None
        self.values_dropped = 0
        self.render_errors = 0
        self.last_guard: str | None = None  # see the module docstring
        self.last_action: str | None = None
        self.last_restart: tuple[str, float] | None = None  # (role, wall-clock time)
        self.note: str | None = None

    # ---- state --------------------------------------------------------------------------------

    def update(self, records: list[MetricRecords]) -> None:
        for rec in records:
            self.records += 1
            values = self._clean(rec.values)
            self._note_control(values)
            self._note_restart(values, rec.time)
            self.latest.update(values)
            self._by_source.setdefault(f"{rec.role}/{rec.id}", {}).update(values)
            for k in SPARK_KEYS:
                v = values.get(k)
                if isinstance(v, float):
                    self._history[k].append(v)
            ev = values.get("eval/reward")
            if isinstance(ev, float) and not math.isnan(ev):
                if self.eval_first is None:
                    self.eval_first = ev
                self.eval_best = ev if self.eval_best is None else max(self.eval_best, ev)
        if records:
            self._dirty = True

    def _clean(self, values: dict) -> dict:
        """Floats and lists of floats; the wire decoder yields only those, records built
        in-process may carry ints (converted) or anything else (dropped, counted)."""
        out = {}
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = float(v)
            elif isinstance(v, list) and all(isinstance(x, float) for x in v):
                out[k] = v
            else:
                self.values_dropped += 1
        return out

    def _note_control(self, values: dict) -> None:
        """The guard and action whose counters just moved (before ``latest`` takes them); of
        several guards in one record the first, whose values ``control/last_*`` are."""
        for prefix, attr in (("control/guard/", "last_guard"), ("control/action/", "last_action")):
            moved = [k for k, v in values.items() if k.startswith(prefix) and isinstance(v, float)
                     and v > 0 and v != self.get(k)]
            if moved:
                setattr(self, attr, moved[0][len(prefix):][:32])

    def _note_restart(self, values: dict, t: float) -> None:
        moved = [k for k, v in values.items() if k.startswith(RESTARTS) and isinstance(v, float)
                 and v > 0 and v != self.get(k)]
        if moved:
            self.last_restart = (moved[0][len(RESTARTS):][:32], t)

    def restarts_text(self) -> str | None:
        """``3 · last actor0 12s ago``; None while no role has restarted."""
        counts = [v for k, v in self.latest.items() if k.startswith(RESTARTS) and isinstance(v, float)
                  and math.isfinite(v) and v > 0]
        if not counts:
            return None
        out = fmt(sum(counts), 0)
        if self.last_restart is not None:
            role, t = self.last_restart
            out += f" · last {role} {fmt_duration(max(0.0, time.time() - t))} ago"
        return out

    def control_text(self) -> str | None:
        """``s≤3 · ratio_p99 2.31 vs 2.00 @57 → skip_step``; None before the learner reports it."""
        limit = self.get("control/max_staleness")
        if limit is None:
            return None
        out = f"s≤{fmt(limit, 0)}" + (" paused" if self.get("control/paused") else "")
        if self.last_guard is not None:
            g = self.get
            out += (f" · {self.last_guard} {fmt(g('control/last_value'), 2)} vs {fmt(g('control/last_threshold'), 2)}"
                    f" @{fmt(g('control/last_step'), 0)} → {self.last_action or '?'}")
        return out

    def get(self, key: str):
        v = self.latest.get(key)
        return None if isinstance(v, list) else v

    def actor_tokens_per_s(self) -> float | None:
        """Sum of the latest ``actor/tokens_per_s`` of every source that reports it."""
        rates = [
            v.get("actor/tokens_per_s")
            for v in self._by_source.values()
            if isinstance(v.get("actor/tokens_per_s"), float)
        ]
        return sum(r for r in rates if not math.isnan(r)) if rates else None

    def actor_versions(self) -> dict[str, int]:
        return {
            src.split("/", 1)[1]: int(v["actor/version"])
            for src, v in sorted(self._by_source.items())
            if isinstance(v.get("actor/version"), float) and abs(v["actor/version"]) < MAX_VERSION
        }

    def elapsed(self) -> float:
        v = self.get("time/elapsed_s")
        return v if v is not None and math.isfinite(v) else time.time() - self.start_time

    def progress(self) -> float:
        """Fraction of the run budget used: steps or wall time, whichever is nearer to done."""
        fracs = []
        step = self.get("learner/step")
        if self.max_steps and step is not None and math.isfinite(step):
            fracs.append(step / self.max_steps)
        if self.max_time_s:
            fracs.append(self.elapsed() / self.max_time_s)
        return min(max(fracs, default=0.0), 1.0)

    def staleness_rows(self) -> list[tuple[str, float | None, float | None]]:
        """(label, count, ratio p99) per staleness; the tail past MAX_STALENESS_ROWS is merged."""
        hist = self.latest.get("staleness/hist")
        counts = list(hist) if isinstance(hist, list) else []
        p99 = {}
        for k, v in self.latest.items():
            suffix = k[len(BY_STALENESS) :]
            # staleness is bounded by buffer.max_staleness; the size cap only stops a bad key
            # (and isascii a digit like "²", which isdigit accepts and int refuses)
            if k.startswith(BY_STALENESS) and suffix.isascii() and suffix.isdigit() and len(suffix) < 5:
                if isinstance(v, float):
                    p99[int(suffix)] = v
        n = max(len(counts), max(p99, default=-1) + 1)
        rows = [(str(s), counts[s] if s < len(counts) else None, p99.get(s)) for s in range(n)]
        if len(rows) > MAX_STALENESS_ROWS:
            head, tail = rows[: MAX_STALENESS_ROWS - 1], rows[MAX_STALENESS_ROWS - 1 :]
            c = [r[1] for r in tail if r[1] is not None]
            p = [r[2] for r in tail if r[2] is not None and not math.isnan(r[2])]
            rows = head + [(f"≥{tail[0][0]}", sum(c) if c else None, max(p) if p else None)]
        return rows

    def _step_text(self) -> str:
        budget = f"/{self.max_steps}" if self.max_steps else ""
        stage = f"{self.stage} · " if self.stage else ""
        return f"{stage}step {fmt(self.get('learner/step'), 0)}{budget}"

    def summary(self) -> dict:
        out = dict(self.latest)
        tok = self.actor_tokens_per_s()
        if tok is not None:
            out["actor/tokens_per_s"] = tok
        if self.eval_first is not None:
            out["eval/reward_first"] = self.eval_first
            out["eval/reward_best"] = self.eval_best
        out["time/elapsed_s"] = self.elapsed()
        out["monitor/records"] = self.records
        out["monitor/values_dropped"] = self.values_dropped
        return out

    # ---- plain line -----------------------------------------------------------------------------

    def format_line(self) -> str:
        g = self.get
        head = f"[{fmt_duration(self.elapsed()):>6}] {self._step_text()}"
        if g("learner/version") is not None:
            head += f" v{fmt(g('learner/version'), 0)}"
        parts = [head]
        if g("eval/reward") is not None:
            parts.append(f"eval {fmt(g('eval/reward'), 2)} (start {fmt(self.eval_first, 2)})")
        if g("reward/mean") is not None:
            parts.append(f"reward {fmt(g('reward/mean'), 2)}")
        if g("length/mean") is not None:
            limit = "" if g("length/limit") is None else f" (limit {fmt(g('length/limit'), 0)})"
            parts.append(f"len {fmt(g('length/mean'), 1)}{limit}")
        if g("ratio/p50") is not None or g("ratio/p99") is not None:
            parts.append(
                f"ratio p50 {fmt(g('ratio/p50'))} p99 {fmt(g('ratio/p99'), 2)} "
                f"max {fmt(g('ratio/max'), 1)}"
            )
        hist = self.latest.get("staleness/hist")
        if isinstance(hist, list) and hist:
            inner = ", ".join(f"{s}: {fmt(c, 0)}" for s, c in enumerate(hist) if c and c == c)
            parts.append(f"stale {{{inner}}}")
        ctl = self.control_text()
        if ctl is not None:
            parts.append(f"ctl {ctl}")
        parts.extend(self._line_buffer_and_rates())
        rst = self.restarts_text()
        if rst is not None:
            parts.append(f"restarts {rst}")
        if self.note:
            parts.append(self.note)
        return " | ".join(parts)

    def _line_buffer_and_rates(self) -> list[str]:
        g = self.get
        out = []
        if g("buffer/depth") is not None:
            s = f"buf {fmt(g('buffer/depth'), 0)}"
            drops = [(n, g(f"buffer/{k}")) for n, k in _DROPS]
            drops = [f"{n} {fmt(v, 0)}" for n, v in drops if v]
            out.append(s + (f" (drop {' '.join(drops)})" if drops else ""))
        tok = self.actor_tokens_per_s()
        if tok is not None:
            out.append(f"act {fmt(tok, 0)} tok/s")
        if g("learner/tokens_per_s") is not None:
            s = f"lrn {fmt(g('learner/tokens_per_s'), 0)} tok/s"
            if g("learner/idle_frac") is not None:
                s += f" idle {fmt(g('learner/idle_frac'), 2)}"
            out.append(s)
        return out

    # ---- rich dashboard -------------------------------------------------------------------------

    def renderable(self):
        rows = [
            [self._reward_panel(), self._ratio_panel(), self._staleness_panel()],
            [self._throughput_panel(), self._buffer_panel(), self._sync_panel()],
        ]
        grids = [self._header()]
        for row in rows:
            height = max(len(body.rows) for _, body in row) + 2
            grid = Table.grid(expand=True)
            for _ in row:
                grid.add_column(ratio=1)
            grid.add_row(
                *(Panel(body, title=title, title_align="left", height=height, box=box.ROUNDED)
                  for title, body in row)
            )
            grids.append(grid)
        return Group(*grids)

    def _header(self):
        frac = self.progress()
        g = self.get
        info = Text()
        info.append(f"{frac * 100:3.0f}% ", style="bold")
        info.append(self._step_text())
        info.append("  ·  " + fmt_duration(self.elapsed()))
        if self.max_time_s:
            info.append(f"/{fmt_duration(self.max_time_s)}")
        info.append(f"  ·  policy v{fmt(g('learner/version'), 0)}", style="bold cyan")
        grid = Table.grid(expand=True, padding=(0, 1))
        grid.add_column(width=10, no_wrap=True)
        grid.add_column(ratio=1)
        grid.add_column(no_wrap=True, justify="right")
        grid.add_row(
            Text("driftrl", style="bold magenta"),
            ProgressBar(total=1.0, completed=frac, complete_style="green", finished_style="green"),
            info,
        )
        status = self._status_text()
        return grid if status is None else Group(grid, status)

    def _status_text(self) -> Text | None:
        """Restarts and the note, on their own line under the bar: a narrow terminal crops them
        there instead of squeezing the bar and the step counter."""
        rst, out = self.restarts_text(), Text(" " * 11, no_wrap=True, overflow="ellipsis")
        if rst is not None:
            out.append(f"restarts {rst}", style="bold yellow")
        if self.note:
            out.append(("  ·  " if rst is not None else "") + self.note, style="dim")
        return out if rst is not None or self.note else None

    @staticmethod
    def _kv() -> Table:
        # the third column (sparklines, units) absorbs the squeeze on narrow terminals
        t = Table.grid(padding=(0, 1), expand=True)
        t.add_column(style="dim", no_wrap=True)
        t.add_column(justify="right", no_wrap=True)
        t.add_column(no_wrap=True, overflow="crop", ratio=1)
        return t

    def _cell(self, key: str, digits: int = 3, value=None) -> Text:
        v = self.get(key) if value is None else value
        return Text(fmt(v, digits), style=grade(key, v))

    def _reward_panel(self):
        t = self._kv()
        ev, first = self.get("eval/reward"), self.eval_first
        style = ""
        if ev is not None and first is not None and not math.isnan(ev):
            style = "bold green" if ev > first else "bold red" if ev < first else ""
        t.add_row("eval", Text(fmt(ev, 3), style=style),
                  Text(sparkline(self._history["eval/reward"]), style="cyan"))
        t.add_row("  start", fmt(first, 3), Text(f"best {fmt(self.eval_best, 3)}", style="dim"))
        t.add_row("train", self._cell("reward/mean"),
                  Text(sparkline(self._history["reward/mean"]), style="cyan"))
        t.add_row("length", self._cell("length/mean", 1),
                  Text(sparkline(self._history["length/mean"]), style="cyan"))
        p90, mx = fmt(self.get("length/p90"), 0), fmt(self.get("length/max"), 0)
        limit = self.get("length/limit")  # the length curriculum's, when one runs
        t.add_row("  p90/max", f"{p90}/{mx}", Text("" if limit is None else f"limit {fmt(limit, 0)}", style="dim"))
        return "reward (held-out · train)", t

    def _ratio_panel(self):
        t = self._kv()
        t.add_row("p50", self._cell("ratio/p50"), "")
        t.add_row("p99", self._cell("ratio/p99"),
                  Text(sparkline(self._history["ratio/p99"]), style="cyan"))
        t.add_row("max", self._cell("ratio/max"), "")
        t.add_row("ess", self._cell("ratio/ess"), "")
        t.add_row("clip", self._pct("ratio/clip_frac"), "")
        t.add_row("kl k3", self._cell("mismatch/kl_k3"), "")
        ctl = self.control_text()
        if ctl is not None:  # the limit, then the last trip (the cropping column: it can be long)
            limit, _, trip = ctl.partition(" · ")
            t.add_row("control", limit, Text(trip, style="bold red" if trip else ""))
        return "ratio π_learner/π_behaviour", t

    def _pct(self, key: str, digits: int = 2) -> Text:
        v = self.get(key)
        s = "–" if v is None else "nan" if math.isnan(v) else f"{v * 100:.{digits}f}%"
        return Text(s, style=grade(key, v))

    def _staleness_panel(self):
        t = Table.grid(padding=(0, 1))
        t.add_column(style="dim", justify="right", no_wrap=True)
        t.add_column(no_wrap=True)
        t.add_column(justify="right", no_wrap=True)
        t.add_column(justify="right", no_wrap=True)
        rows = self.staleness_rows()
        t.add_row("s", Text("samples", style="dim"), "", Text("ρ p99", style="dim"))
        # the longest bar is the largest finite count; inf (and anything past it) is drawn full
        top = max((c for _, c, _ in rows if c is not None and 0 < c < math.inf), default=1.0)
        for label, count, p99 in rows:
            frac = 0.0 if count is None else count / top
            t.add_row(label, Text(bar(frac, 10), style="blue"), fmt(count, 0),
                      self._cell("ratio/p99", value=p99) if p99 is not None else Text("–"))
        if not rows:
            t.add_row("", Text("no samples yet", style="dim"), "", "")
        mean, mx = self.get("staleness/mean"), self.get("staleness/max")
        title = f"staleness (mean {fmt(mean, 2)} max {fmt(mx, 0)})"
        return title, t

    def _throughput_panel(self):
        t = self._kv()
        n_act = sum(1 for v in self._by_source.values() if "actor/tokens_per_s" in v)
        t.add_row("actors", Text(fmt(self.actor_tokens_per_s(), 0), style="bold"),
                  f"tok/s ×{n_act}")
        t.add_row("learner", Text(fmt(self.get("learner/tokens_per_s"), 0), style="bold"), "tok/s")
        t.add_row("idle", self._pct("learner/idle_frac", 1), "learner")
        t.add_row("groups", fmt(self.get("actor/groups_per_s"), 2), "/s")
        return "throughput", t

    def _buffer_panel(self):
        t = self._kv()
        t.add_row("depth", Text(fmt(self.get("buffer/depth"), 0), style="bold"), "groups")
        for name, key in _DROPS:
            v = self.get(f"buffer/{key}")
            t.add_row(name, Text(fmt(v, 0), style="yellow" if v else ""), "")
        return "buffer", t

    def _sync_panel(self):
        t = self._kv()
        t.add_row("learner", Text(f"v{fmt(self.get('learner/version'), 0)}", style="bold cyan"), "")
        av = self.actor_versions()
        if av:
            shown = " ".join(f"{k}:v{v}" for k, v in list(av.items())[:4])
            more = f" +{len(av) - 4}" if len(av) > 4 else ""
            t.add_row("actors", shown + more, "")
        t.add_row("publish", self._secs("weightsync/publish_s"), "")
        t.add_row("apply", self._secs("weightsync/apply_s"), "")
        b = self.get("weightsync/bytes")
        if b is not None:
            t.add_row("bytes", fmt(b / 2**20, 1) + " MiB", "")
        return "versions · weight sync", t

    def _secs(self, key: str) -> str:
        v = self.get(key)
        return "–" if v is None else "nan" if math.isnan(v) else f"{v * 1e3:.1f} ms"

    # ---- output -------------------------------------------------------------------------------

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_render < self.refresh_s:
            return
        self._last_render = now
        try:
            self._draw(force, now)
        except Exception:  # noqa: BLE001 -- a view bug must not end the run it shows
            self._render_failed()

    def _render_failed(self) -> None:
        self.render_errors += 1
        if self.render_errors == 1:
            log.exception("the live view failed to render (the run continues; counted in render_errors)")

    def _draw(self, force: bool, now: float) -> None:
        if self._live is not None:
            self._live.update(self.renderable(), refresh=True)
            self._dirty = False
            return
        if self.live:
            return  # live mode outside the context manager: nothing to draw on
        # plain: a line when something new arrived (at most one per plain_every_s), and a
        # keep-alive line during long stalls
        if force or now - self._last_line >= self.plain_every_s * (1 if self._dirty else 6):
            self.console.print(self.format_line(), markup=False, highlight=False, soft_wrap=True)
            self._last_line = now
            self._dirty = False

    def __enter__(self):
        if self.live:
            self._live = Live(
                self.renderable(),
                console=self.console,
                auto_refresh=False,
                transient=False,
                redirect_stdout=True,
                redirect_stderr=True,
            )
            self._live.start(refresh=True)
        return self

    def __exit__(self, *exc):
        # Live.stop restores the cursor even on KeyboardInterrupt; the last frame stays on screen
        try:
            if self._live is not None:
                self._live.update(self.renderable(), refresh=True)
            elif self._dirty:
                self.refresh(force=True)
        except Exception:  # noqa: BLE001 -- as in refresh
            self._render_failed()
        finally:
            if self._live is not None:
                self._live.stop()
                self._live = None
        return False


_DROPS = (("stale", "dropped_stale"), ("invalid", "dropped_invalid"), ("dup", "duplicates"))
