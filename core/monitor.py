"""The live view of a run: a rich ``Live`` dashboard on a TTY (or ``monitor.live = "on"``), else a plain
line at most every ``monitor.plain_every_s`` s. It shows what roles reported ("–" otherwise), hostile values
as such, and a render that fails anyway is logged once and counted: a view must never stop a run."""

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
from rich.table import Column, Table
from rich.text import Text

from core.funnel import Funnel
from core.messages import MetricRecords

SPARK_KEYS = ("eval/reward", "reward/mean", "length/mean", "ratio/p99", "tool/correct_rate")
_SPARK = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▏▎▍▌▋▊▉"
MAX_STALENESS_ROWS = 8
BY_STALENESS = "ratio/p99_by_staleness/"
RESTARTS = "run/restarts/"
MAX_VERSION = 2**53  # larger (or non-integral floats) cannot be a policy version
_DROPS = (("stale", "dropped_stale"), ("invalid", "dropped_invalid"), ("dup", "duplicates"))

log = logging.getLogger(__name__)

# (green below, yellow below, else red) for metrics where larger is worse
THRESHOLDS = {"ratio/p99": (1.1, 1.5), "ratio/max": (2.0, 10.0), "ratio/clip_frac": (0.01, 0.05),
              "mismatch/kl_k3": (1e-3, 1e-2), "learner/idle_frac": (0.2, 0.5)}


def fmt(v, digits: int = 3) -> str:
    """Compact number: '–' missing, 'nan', 12.3k for large, 1.2e-04 for tiny."""
    if v is None or isinstance(v, list):
        return "–"
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"
    a = abs(v)
    if a >= 1e15 or (digits > 0 and 0 < a < 10 ** -digits):
        return f"{v:.1e}"
    if a >= 1e4:
        return f"{v / 1e6:.1f}M" if a >= 1e6 else f"{v / 1e3:.1f}k"
    return f"{v:.0f}" if a >= 100 else f"{v:.{digits}f}"


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
    if key not in THRESHOLDS or v is None or isinstance(v, list):
        return ""
    good, warn = THRESHOLDS[key]
    return "green" if v < good else "yellow" if v < warn else "bold red"  # NaN: red


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
    full, part = divmod(round(frac * width * 8), 8)
    return ("█" * full + (_EIGHTHS[part] if part else "")).ljust(width)


def _moved(values: dict, latest: dict, prefix: str) -> str | None:
    """The name after ``prefix`` of the first counter in ``values`` that went up since ``latest``."""
    moved = [k for k, v in values.items() if k.startswith(prefix) and isinstance(v, float)
             and v > 0 and v != latest.get(k)]
    return moved[0][len(prefix):][:32] if moved else None


class Monitor:
    def __init__(self, cfg, console: Console | None = None, live: bool | str | None = None):
        """``live``: a bool, or a ``monitor.live`` mode overriding the config's."""
        self.console = console or Console()
        mode = cfg.monitor.live if live is None else live
        self.live = mode in (True, "on") or (mode == "auto" and self.console.is_terminal)
        self.refresh_s, self.plain_every_s = cfg.monitor.refresh_s, cfg.monitor.plain_every_s
        self.max_steps, self.max_time_s = cfg.run.max_steps, cfg.run.max_time_s
        self.stage = cfg.run.stage  # a pipeline's stage (pipeline.py): leads the step counter
        self.start_time = time.time()
        self.records = self.render_errors = 0
        self.latest: dict[str, float | list[float]] = {}
        self._by_source: dict[str, dict[str, float | list[float]]] = {}  # "role/id" -> values
        self._history = {k: deque(maxlen=60) for k in SPARK_KEYS}  # the points of each sparkline
        self.eval_first = self.eval_best = None  # of eval/reward
        self._last_render = self._last_line = -math.inf
        self._dirty = False
        self._live: Live | None = None
        # the control guard and action whose counters last went up (metrics carry numbers only)
        self.last_guard = self.last_action = None
        self.last_restart: tuple[str, float] | None = None  # (role, wall-clock time of the record)
        self.note: str | None = None  # a status an embedding command sets, shown in the header
        self.funnel = Funnel()  # where the generated groups went (core/funnel.py)

    def update(self, records: list[MetricRecords]) -> None:
        for rec in records:
            self.records += 1
            values = rec.values  # floats and lists of floats (metrics.record_from_json)
            # of several guards in one record the first, whose values control/last_* are
            self.last_guard = _moved(values, self.latest, "control/guard/") or self.last_guard
            self.last_action = _moved(values, self.latest, "control/action/") or self.last_action
            if (role := _moved(values, self.latest, RESTARTS)) is not None:
                self.last_restart = (role, rec.time)
            self.latest.update(values)
            self._by_source.setdefault(f"{rec.role}/{rec.id}", {}).update(values)
            self.funnel.update(f"{rec.role}/{rec.id}", values)
            for k in SPARK_KEYS:
                if isinstance(values.get(k), float):
                    self._history[k].append(values[k])
            if isinstance(ev := values.get("eval/reward"), float) and not math.isnan(ev):
                self.eval_first = ev if self.eval_first is None else self.eval_first
                self.eval_best = ev if self.eval_best is None else max(self.eval_best, ev)
        self._dirty = self._dirty or bool(records)

    def restarts_text(self) -> str | None:
        """``3 · last actor0 12s ago`` (the launcher's ``run/restarts/<role>``); None without one."""
        counts = [v for k, v in self.latest.items() if k.startswith(RESTARTS) and isinstance(v, float)
                  and math.isfinite(v) and v > 0]
        if not counts:
            return None
        role, t = self.last_restart or (None, 0.0)
        ago = fmt_duration(max(0.0, time.time() - t))
        return fmt(sum(counts), 0) + ("" if role is None else f" · last {role} {ago} ago")

    def control_text(self) -> str | None:
        """``s≤3 · ratio_p99 2.31 vs 2.00 @57 → skip_step``; None before the learner reports it."""
        g = self.get
        if g("control/max_staleness") is None:
            return None
        out = f"s≤{fmt(g('control/max_staleness'), 0)}" + (" paused" if g("control/paused") else "")
        if self.last_guard is not None:
            out += (f" · {self.last_guard} {fmt(g('control/last_value'), 2)}"
                    f" vs {fmt(g('control/last_threshold'), 2)} @{fmt(g('control/last_step'), 0)}"
                    f" → {self.last_action or '?'}")
        return out

    def get(self, key: str):
        v = self.latest.get(key)
        return None if isinstance(v, list) else v

    def actor_tokens_per_s(self) -> float | None:
        rates = [r for v in self._by_source.values() if isinstance(r := v.get("actor/tokens_per_s"), float)]
        return sum(r for r in rates if not math.isnan(r)) if rates else None

    def actor_versions(self) -> dict[str, int]:
        return {src.split("/", 1)[1]: int(v["actor/version"]) for src, v in sorted(self._by_source.items())
                if isinstance(v.get("actor/version"), float) and abs(v["actor/version"]) < MAX_VERSION}

    def elapsed(self) -> float:
        v = self.get("time/elapsed_s")
        return v if v is not None and math.isfinite(v) else time.time() - self.start_time

    def progress(self) -> float:
        """Fraction of the run budget used: steps or wall time, whichever is nearer to done."""
        step = self.get("learner/step")
        fracs = [step / self.max_steps] if self.max_steps and step is not None and math.isfinite(step) else []
        fracs += [self.elapsed() / self.max_time_s] if self.max_time_s else []
        return min(max(fracs, default=0.0), 1.0)

    def staleness_rows(self) -> list[tuple[str, float | None, float | None]]:
        """(label, count, ratio p99) per staleness; the tail past MAX_STALENESS_ROWS is merged."""
        hist = self.latest.get("staleness/hist")
        counts = list(hist) if isinstance(hist, list) else []
        # the size cap only stops a bad key (and isascii a digit like "²", which int refuses)
        p99 = {int(s): v for k, v in self.latest.items() if k.startswith(BY_STALENESS) and isinstance(v, float)
               and (s := k[len(BY_STALENESS):]).isascii() and s.isdigit() and len(s) < 5}
        n = max(len(counts), max(p99, default=-1) + 1)
        rows = [(str(s), counts[s] if s < len(counts) else None, p99.get(s)) for s in range(n)]
        if len(rows) > MAX_STALENESS_ROWS:
            head, tail = rows[: MAX_STALENESS_ROWS - 1], rows[MAX_STALENESS_ROWS - 1:]
            c = [r[1] for r in tail if r[1] is not None]
            p = [r[2] for r in tail if r[2] is not None and not math.isnan(r[2])]
            rows = head + [(f"≥{tail[0][0]}", sum(c) if c else None, max(p) if p else None)]
        return rows

    def _step_text(self) -> str:
        budget = f"/{self.max_steps}" if self.max_steps else ""
        stage = f"{self.stage} · " if self.stage else ""
        return f"{stage}step {fmt(self.get('learner/step'), 0)}{budget}"

    def format_line(self) -> str:
        g, hist = self.get, self.latest.get("staleness/hist")

        def opt(key: str, form: str, digits: int = 2) -> str:  # ``form`` with the value; "" when not reported
            return "" if g(key) is None else form.format(fmt(g(key), digits))

        drops = " ".join(f"{n} {fmt(g(f'buffer/{k}'), 0)}" for n, k in _DROPS if g(f"buffer/{k}"))
        ctl, tok, rst = self.control_text(), self.actor_tokens_per_s(), self.restarts_text()
        u = g("actor/uniform_frac")
        parts = [  # each part only when its metric was reported
            f"[{fmt_duration(self.elapsed()):>6}] {self._step_text()}" + opt("learner/version", " v{}", 0),
            opt("eval/reward", f"eval {{}} (start {fmt(self.eval_first, 2)})"),
            opt("reward/mean", "reward {}"),
            opt("length/mean", "len {}" + opt("length/limit", " (limit {})", 0), 1),
            opt("episode/turns", f"turns {{}} tools {self.tools_text()}" + opt("tool/correct_rate", " correct {}")),
            (g("ratio/p50") is not None or g("ratio/p99") is not None)
            and f"ratio p50 {fmt(g('ratio/p50'))} p99 {fmt(g('ratio/p99'), 2)} max {fmt(g('ratio/max'), 1)}",
            isinstance(hist, list) and hist
            and "stale {" + ", ".join(f"{s}: {fmt(c, 0)}" for s, c, _ in self.staleness_rows() if c and c == c) + "}",
            ctl is not None and f"ctl {ctl}",
            opt("buffer/depth", "buf {}" + (f" (drop {drops})" if drops else ""), 0),
            tok is not None and f"act {fmt(tok, 0)} tok/s" + (f" ({fmt(100 * u, 0)}% no signal)" if u else ""),
            opt("learner/tokens_per_s", "lrn {} tok/s" + opt("learner/idle_frac", " idle {}"), 0),
            rst is not None and f"restarts {rst}",
            (fl := self.funnel.line()) is not None and f"funnel {fl}",
            self.note,
        ]
        return " | ".join(p for p in parts if p)

    def renderable(self):
        grids = [self._header()]
        for row in ((self._reward_panel(), self._ratio_panel(), self._staleness_panel()),
                    (self._throughput_panel(), self._buffer_panel(), self._sync_panel())):
            height = max(len(body.rows) for _, body in row) + 2
            grid = Table.grid(*(Column(ratio=1) for _ in row), expand=True)
            grid.add_row(*(Panel(body, title=title, title_align="left", height=height, box=box.ROUNDED)
                           for title, body in row))
            grids.append(grid)
        if (line := self.funnel.line()) is not None:
            grids.append(Text.assemble(("funnel ", "bold"), line, no_wrap=True, overflow="ellipsis"))
        return Group(*grids)

    def _header(self):
        frac = self.progress()
        info = Text.assemble((f"{frac * 100:3.0f}% ", "bold"), self._step_text(),
                             "  ·  " + fmt_duration(self.elapsed()),
                             f"/{fmt_duration(self.max_time_s)}" if self.max_time_s else "",
                             (f"  ·  policy v{fmt(self.get('learner/version'), 0)}", "bold cyan"))
        grid = Table.grid(Column(width=10, no_wrap=True), Column(ratio=1), Column(no_wrap=True, justify="right"),
                          expand=True, padding=(0, 1))
        grid.add_row(Text("driftrl", style="bold magenta"),
                     ProgressBar(total=1.0, completed=frac, complete_style="green", finished_style="green"), info)
        # restarts and the note on their own line: a narrow terminal crops them, not the bar
        rst, status = self.restarts_text(), Text(" " * 11, no_wrap=True, overflow="ellipsis")
        if rst is not None:
            status.append(f"restarts {rst}", style="bold yellow")
        if self.note:
            status.append(("  ·  " if rst is not None else "") + self.note, style="dim")
        return Group(grid, status) if rst is not None or self.note else grid

    @staticmethod
    def _panel(title: str, *rows) -> tuple[str, Table]:
        """(title, a label/value/extra table of ``rows``, None rows left out)."""
        # the third column (sparklines, units) absorbs the squeeze on narrow terminals
        t = Table.grid(Column(style="dim", no_wrap=True), Column(justify="right", no_wrap=True),
                       Column(no_wrap=True, overflow="crop", ratio=1), padding=(0, 1), expand=True)
        for row in filter(None, rows):
            t.add_row(*row)
        return title, t

    def _cell(self, key: str, digits: int = 3) -> Text:
        v = self.get(key)
        return Text(fmt(v, digits), style=grade(key, v))

    def _spark(self, key: str) -> Text:
        return Text(sparkline(self._history[key]), style="cyan")

    def _scaled(self, key: str, scale: float, form: str, digits: int = 2) -> Text:
        """``key`` times ``scale`` in ``form`` (``{}%``, ``{} ms``), graded like the value."""
        v = self.get(key)
        s = "–" if v is None else "nan" if math.isnan(v) else form.format(f"{v * scale:.{digits}f}")
        return Text(s, style=grade(key, v))

    def _reward_panel(self):
        ev, first, limit = self.get("eval/reward"), self.eval_first, self.get("length/limit")
        style = "" if ev is None or first is None else "bold green" if ev > first else "bold red" if ev < first else ""
        return self._panel(
            "reward (held-out · train)",
            ("eval", Text(fmt(ev, 3), style=style), self._spark("eval/reward")),
            ("  start", fmt(first, 3), Text(f"best {fmt(self.eval_best, 3)}", style="dim")),
            ("train", self._cell("reward/mean"), self._spark("reward/mean")),
            ("length", self._cell("length/mean", 1), self._spark("length/mean")),
            ("  p90/max", f"{fmt(self.get('length/p90'), 0)}/{fmt(self.get('length/max'), 0)}",
             Text("" if limit is None else f"limit {fmt(limit, 0)}", style="dim")),  # the length curriculum's
            self.get("episode/turns") is not None and ("turns", self._cell("episode/turns", 2), self.tools_text()),
            self.get("tool/correct_rate") is not None
            and ("tool use", self._cell("tool/correct_rate", 2), self._spark("tool/correct_rate")))

    def tools_text(self) -> str:
        """Tool-call outcomes so far (actor/episodes.py)."""
        return " ".join(f"{n} {fmt(self.get(f'tool/{k}'), 0)}" for n, k in
                        (("ok", "ok"), ("err", "errors"), ("timeout", "timeouts"), ("bad", "malformed")))

    def _ratio_panel(self):
        # the control's limit, then its last trip (in the cropping column: it can be long)
        limit, _, trip = (self.control_text() or "").partition(" · ")
        return self._panel(
            "ratio π_learner/π_behaviour",
            ("p50", self._cell("ratio/p50")),
            ("p99", self._cell("ratio/p99"), self._spark("ratio/p99")),
            ("max", self._cell("ratio/max")),
            ("ess", self._cell("ratio/ess")),
            ("clip", self._scaled("ratio/clip_frac", 100, "{}%")),
            ("kl k3", self._cell("mismatch/kl_k3")),
            ("control", limit, Text(trip, style="bold red" if trip else "")) if limit else None)

    def _staleness_panel(self):
        t = Table.grid(Column(style="dim", justify="right", no_wrap=True), Column(no_wrap=True),
                       Column(justify="right", no_wrap=True), Column(justify="right", no_wrap=True), padding=(0, 1))
        rows = self.staleness_rows()
        t.add_row("s", Text("samples", style="dim"), "", Text("ρ p99", style="dim"))
        # the longest bar is the largest finite count; inf (and anything past it) is drawn full
        top = max((c for _, c, _ in rows if c is not None and 0 < c < math.inf), default=1.0)
        for label, count, p99 in rows:
            t.add_row(label, Text(bar(0.0 if count is None else count / top, 10), style="blue"),
                      fmt(count, 0), Text(fmt(p99), style=grade("ratio/p99", p99)))
        if not rows:
            t.add_row("", Text("no samples yet", style="dim"), "", "")
        return f"staleness (mean {fmt(self.get('staleness/mean'), 2)} max {fmt(self.get('staleness/max'), 0)})", t

    def _throughput_panel(self):
        n_act = sum(1 for v in self._by_source.values() if "actor/tokens_per_s" in v)
        return self._panel(
            "throughput",
            ("actors", Text(fmt(self.actor_tokens_per_s(), 0), style="bold"), f"tok/s ×{n_act}"),
            ("learner", Text(fmt(self.get("learner/tokens_per_s"), 0), style="bold"), "tok/s"),
            ("idle", self._scaled("learner/idle_frac", 100, "{}%", 1), "learner"),
            ("groups", fmt(self.get("actor/groups_per_s"), 2), "/s"),
            ("no signal", self._scaled("actor/uniform_frac", 100, "{}%", 0), "left out"),
            ("memory", self._scaled("learner/rss_mb", 1 / 1024, "{} GB", 1),
             "learner" + ("" if (p := self.get("learner/peak_rss_mb")) is None else f", peak {fmt(p / 1024, 1)}")))

    def _buffer_panel(self):
        drops = ((name, self.get(f"buffer/{key}")) for name, key in _DROPS)
        return self._panel("buffer", ("depth", Text(fmt(self.get("buffer/depth"), 0), style="bold"), "groups"),
                           *((n, Text(fmt(v, 0), style="yellow" if v else "")) for n, v in drops))

    def _sync_panel(self):
        av, b = self.actor_versions(), self.get("weightsync/bytes")
        shown = " ".join(f"{k}:v{v}" for k, v in list(av.items())[:4])
        shown += f" +{len(av) - 4}" if len(av) > 4 else ""
        # with deltas (weightsync/delta.py): the mean sent per version against a full one, and the last change
        per, frac = self.get("weightsync/bytes_per_version"), self.get("weightsync/sent_frac")
        delta = per is not None and frac is not None
        return self._panel(
            "versions · weight sync",
            ("learner", Text(f"v{fmt(self.get('learner/version'), 0)}", style="bold cyan")),
            ("actors", shown) if av else None,
            ("publish", self._scaled("weightsync/publish_s", 1e3, "{} ms", 1)),
            ("apply", self._scaled("weightsync/apply_s", 1e3, "{} ms", 1)),
            ("bytes", fmt(b / 2**20, 1) + " MiB") if b is not None else None,
            delta and ("sent/version", f"{fmt(per / 2**20, 2)} MiB"), delta and ("of a full", f"{fmt(frac * 100, 1)}%"),
            delta and ("changed", self._scaled("weightsync/changed_frac", 100, "{}%", 2)))

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_render < self.refresh_s:
            return
        self._last_render = now
        try:
            if self._live is not None:
                self._live.update(self.renderable(), refresh=True)
                self._dirty = False
            elif not self.live and (force or now - self._last_line >= self.plain_every_s * (1 if self._dirty else 6)):
                # plain: at most a line per plain_every_s when something arrived, a keep-alive in stalls
                self.console.print(self.format_line(), markup=False, highlight=False, soft_wrap=True)
                self._last_line = now
                self._dirty = False
        except Exception:  # noqa: BLE001 -- a view bug must not end the run it shows
            self.render_errors += 1
            if self.render_errors == 1:
                log.exception("the live view failed to render (the run continues; counted in render_errors)")

    def __enter__(self):
        if self.live:
            self._live = Live(self.renderable(), console=self.console, auto_refresh=False, transient=False,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start(refresh=True)
        return self

    def __exit__(self, *exc):
        # Live.stop restores the cursor even on KeyboardInterrupt; the last frame stays on screen
        try:
            if self._live is not None or self._dirty:
                self.refresh(force=True)
        finally:
            if self._live is not None:
                self._live.stop()
                self._live = None
