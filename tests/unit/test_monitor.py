"""The monitor's state, plain line and rich dashboard, rendered to a recording console."""

import io
import math

import msgspec
import pytest
from rich.console import Console

from core.config import Config
from core.messages import MetricRecords
from core.monitor import Monitor, fmt, grade, sparkline


def cfg_with(**monitor_and_run) -> Config:
    tree = msgspec.to_builtins(Config())
    for dotted, v in monitor_and_run.items():
        sec, key = dotted.split("__")
        tree[sec][key] = v
    return msgspec.convert(tree, Config)


def rec(role, id, step, values, t=1000.0):
    return MetricRecords(role=role, id=id, step=step, time=t + step, values=values)


def run_records(steps: int = 14) -> list[MetricRecords]:
    out = []
    for s in range(steps + 1):
        out.append(rec("learner", "0", s, {
            "learner/step": float(s), "learner/version": float(s),
            "learner/tokens_per_s": 1200.0, "learner/idle_frac": 0.12,
            "ratio/p50": 1.0, "ratio/p99": 1.08, "ratio/max": 1.9, "ratio/ess": 0.987,
            "ratio/clip_frac": 0.002, "mismatch/kl_k3": 1.2e-4,
            "ratio/p99_by_staleness/0": 1.03, "ratio/p99_by_staleness/1": 1.07,
            "ratio/p99_by_staleness/2": 1.61,
            "staleness/hist": [40.0, 24.0, 3.0], "staleness/mean": 0.45, "staleness/max": 2.0,
            "reward/mean": 0.3 + 0.01 * s, "length/mean": 4.1, "time/elapsed_s": 12.3 + s,
            "weightsync/publish_s": 0.0123, "weightsync/apply_s": 0.0045,
        }))
        for a in ("0", "1"):
            out.append(rec("actor", a, s, {"actor/tokens_per_s": 475.0 + int(a) * 10,
                                           "actor/version": float(max(0, s - int(a)))}))
        if s % 7 == 0:  # evals at 0, 7, 14: 0.12, 0.40, 0.31
            out.append(rec("actor", "0", s, {"eval/reward": {0: 0.12, 7: 0.40, 14: 0.31}[s]}))
        out.append(rec("buffer", "0", s, {"buffer/depth": 12.0, "buffer/dropped_stale": 3.0,
                                          "buffer/dropped_invalid": 0.0, "buffer/duplicates": 1.0}))
    return out


def recording_console(width=100, terminal=False) -> Console:
    return Console(record=True, width=width, file=io.StringIO(), force_terminal=terminal,
                   color_system="truecolor" if terminal else None)


@pytest.fixture
def monitor():
    m = Monitor(cfg_with(run__max_steps=150, run__max_time_s=420.0),
                console=recording_console(), live=False)
    m.update(run_records())
    return m


def test_state_tracks_latest_sums_and_eval_first_best(monitor):
    g = monitor.get
    assert g("learner/step") == 14.0 and g("learner/version") == 14.0
    assert monitor.actor_tokens_per_s() == 475.0 + 485.0  # summed over actor ids
    assert g("eval/reward") == 0.31
    assert monitor.eval_first == 0.12 and monitor.eval_best == 0.40
    assert monitor.elapsed() == 12.3 + 14
    assert monitor.records == len(run_records())
    assert monitor.actor_versions() == {"0": 14, "1": 13}


def test_plain_line_contains_values(monitor):
    line = monitor.format_line()
    for part in ("[ 26.3s] step 14/150 v14", "eval 0.31 (start 0.12)", "reward 0.44",
                 "len 4.1", "ratio p50 1.000 p99 1.08 max 1.9", "stale {0: 40, 1: 24, 2: 3}",
                 "buf 12 (drop stale 3 dup 1)", "act 960 tok/s", "lrn 1200 tok/s idle 0.12"):
        assert part in line, (part, line)


def test_plain_refresh_is_throttled_and_forced(monitor):
    monitor.refresh_s = 1e6
    out = monitor.console.file
    monitor.refresh()
    monitor.refresh()  # within refresh_s: nothing new
    assert out.getvalue().count("step 14/150") == 1
    monitor.refresh(force=True)
    assert out.getvalue().count("step 14/150") == 2


def test_plain_lines_at_most_one_per_plain_every_s_even_when_records_keep_coming():
    m = Monitor(cfg_with(monitor__refresh_s=0.001, monitor__plain_every_s=3600.0),
                console=recording_console(), live=False)
    for step in range(5):  # new records before every refresh: only the first draws a line
        m.update(run_records(step))
        m.refresh()
    out = m.console.file.getvalue()
    assert out.count("step ") == 1
    m.refresh(force=True)  # the last line (end of a run) is always written
    assert m.console.file.getvalue().count("step ") == 2
    assert Monitor(cfg_with(), console=recording_console(), live=False).plain_every_s == 10.0  # the default


def test_dashboard_render_contains_panel_numbers(monitor):
    con = monitor.console
    con.print(monitor.renderable())
    text = con.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    for title in ("reward", "ratio", "staleness", "throughput", "buffer", "weight sync"):
        assert title in text
    assert "step 14/150" in text and "policy v14" in text
    assert "0.310" in text and "start" in text and "best 0.400" in text  # eval now/first/best
    assert "1.080" in text and "0.987" in text and "0.20%" in text and "1.2e-04" in text
    assert "960" in text and "1200" in text and "12.0%" in text  # tok/s and idle
    assert "12.3 ms" in text and "4.5 ms" in text
    assert "0:v14" in text and "1:v13" in text
    # staleness rows: label, count and that staleness's ratio p99, on one line
    third = [ln.split("│")[-2] for ln in lines if ln.count("│") == 6]  # "│a││b││c│"
    rows = {cell.split()[0]: cell for cell in third if cell.strip()[:1].isdigit()}
    assert "40" in rows["0"] and "1.030" in rows["0"]
    assert "24" in rows["1"] and "1.070" in rows["1"]
    assert "3" in rows["2"] and "1.610" in rows["2"]
    assert "of a full" not in text  # no deltas published: no delta rows


def test_weight_sync_panel_shows_what_deltas_send(monitor):
    monitor.update([rec("learner", "0", 15, {"weightsync/bytes_per_version": 3.5 * 2**20,
                                             "weightsync/sent_frac": 0.042, "weightsync/changed_frac": 0.0091})])
    monitor.console.print(monitor.renderable())
    text = monitor.console.export_text()
    assert "3.50 MiB" in text and "4.2%" in text and "0.91%" in text


def test_episodes_show_turns_and_tool_calls(monitor):
    assert "turns" not in monitor.format_line()  # single-turn runs: no episode row
    monitor.update([rec("actor", "0", 15, {"episode/turns": 1.85, "tool/ok": 40.0, "tool/errors": 2.0,
                                           "tool/timeouts": 1.0, "tool/malformed": 3.0, "tool/correct_rate": 0.81})])
    assert "turns 1.85 tools ok 40 err 2 timeout 1 bad 3 correct 0.81" in monitor.format_line()
    monitor.console.print(monitor.renderable())
    text = monitor.console.export_text()
    assert "turns" in text and "1.85" in text and "tool use" in text and "0.81" in text


def test_dashboard_colours_ratio_tail(monitor):
    con = recording_console(terminal=True)
    styles = {}
    for seg in con.render(monitor.renderable()):
        if seg.text.strip() in ("1.030", "1.070", "1.610") and seg.style is not None:
            styles.setdefault(seg.text.strip(), set()).add(seg.style.color.name)
    # per-staleness ratio p99: 1.03 and 1.07 are under 1.1 (green), 1.61 is past 1.5 (red)
    assert styles == {"1.030": {"green"}, "1.070": {"green"}, "1.610": {"red"}}


def test_grade_thresholds():
    assert grade("ratio/p99", 1.05) == "green"
    assert grade("ratio/p99", 1.2) == "yellow"
    assert grade("ratio/p99", 2.0) == "bold red"
    assert grade("ratio/p99", math.nan) == "bold red"
    assert grade("learner/loss", 99.0) == ""
    assert grade("ratio/p99", None) == ""


def test_format_helpers():
    assert fmt(None) == "–" and fmt([1.0]) == "–"
    assert fmt(math.nan) == "nan" and fmt(math.inf) == "inf"
    assert fmt(12345.0, 0) == "12.3k" and fmt(0.00012) == "1.2e-04" and fmt(0.4, 0) == "0"
    assert sparkline([1.0, 2.0, 3.0]) == "▁▄█"
    assert sparkline([1.0]) == ""


def test_progress_uses_whichever_budget_is_nearer():
    m = Monitor(cfg_with(run__max_steps=100, run__max_time_s=1000.0),
                console=recording_console(), live=False)
    m.update([rec("learner", "0", 50, {"learner/step": 50.0, "time/elapsed_s": 100.0})])
    assert m.progress() == pytest.approx(0.5)
    m.update([rec("learner", "0", 51, {"learner/step": 51.0, "time/elapsed_s": 900.0})])
    assert m.progress() == pytest.approx(0.9)


def test_staleness_tail_is_merged():
    m = Monitor(Config(), console=recording_console(), live=False)
    hist = [float(10 - s) for s in range(12)]
    vals = {"staleness/hist": hist, "ratio/p99_by_staleness/9": 2.5,
            "ratio/p99_by_staleness/x": 9.0}  # a non-integer suffix is ignored
    m.update([rec("learner", "0", 1, vals)])
    rows = m.staleness_rows()
    assert len(rows) == 8
    assert rows[0] == ("0", 10.0, None)
    assert rows[-1] == ("≥7", sum(hist[7:]), 2.5)


def test_nan_and_missing_values_render():
    m = Monitor(Config(), console=recording_console(), live=False)
    m.console.print(m.renderable())  # nothing reported yet
    m.update([rec("learner", "0", 1, {"ratio/p99": math.nan, "learner/step": 1.0})])
    m.console.print(m.renderable())
    assert "nan" in m.console.export_text()
    assert f"step 1/{m.max_steps}" in m.format_line()


def test_live_mode_choice():
    not_tty = recording_console(terminal=False)
    assert Monitor(cfg_with(monitor__live="auto"), console=not_tty).live is False
    assert Monitor(cfg_with(monitor__live="on"), console=not_tty).live is True
    tty = recording_console(terminal=True)
    assert Monitor(cfg_with(monitor__live="auto"), console=tty).live is True
    assert Monitor(cfg_with(monitor__live="off"), console=tty).live is False


def test_live_context_renders_and_stops_on_interrupt():
    con = recording_console(terminal=True)
    m = Monitor(cfg_with(monitor__live="on"), console=con)
    with pytest.raises(KeyboardInterrupt):
        with m:
            assert m._live is not None and m._live.is_started
            m.update(run_records(3))
            m.refresh(force=True)
            raise KeyboardInterrupt
    assert m._live is None  # stopped, terminal restored
    out = con.file.getvalue()
    assert f"step 3/{m.max_steps}" in out and "policy v3" in out
    assert "\x1b[?25h" in out  # cursor shown again


def test_monitor_fed_by_the_roles_files(tmp_path):
    from core.metrics import MetricsFollower, MetricsWriter

    for i in range(2):
        with MetricsWriter(str(tmp_path), "actor", str(i)) as w:
            w.emit(3, {"actor/tokens_per_s": 100.0 * (i + 1), "actor/version": 3})
    m = Monitor(Config(), console=recording_console(), live=False)
    with MetricsFollower(str(tmp_path)) as follower:
        m.update(follower.read())
    assert m.records == 2
    assert "act 300 tok/s" in m.format_line()
    assert m.actor_versions() == {"0": 3, "1": 3}


# ---- hostile values: the view must never raise ------------------------------------------------

RENDERED_KEYS = (
    "learner/step", "learner/version", "learner/tokens_per_s", "learner/idle_frac",
    "actor/tokens_per_s", "actor/version", "actor/groups_per_s", "eval/reward", "reward/mean",
    "length/mean", "length/p90", "length/max", "ratio/p50", "ratio/p99", "ratio/max", "ratio/ess",
    "ratio/clip_frac", "mismatch/kl_k3", "staleness/hist", "staleness/mean", "staleness/max",
    "ratio/p99_by_staleness/0", "ratio/p99_by_staleness/3", "time/elapsed_s", "buffer/depth",
    "buffer/dropped_stale", "buffer/dropped_invalid", "buffer/duplicates",
    "weightsync/publish_s", "weightsync/apply_s", "weightsync/bytes", "weightsync/bytes_per_version",
    "weightsync/sent_frac", "weightsync/changed_frac", "learner/rss_mb", "learner/peak_rss_mb",
)
HOSTILE = (math.inf, -math.inf, math.nan, 1e300, -1e300, 1e308, -1e308, -7.0, 5e-324, 0.0,
           [math.nan], [math.inf, -math.inf, 1.0], [-3.0, 1e300, math.nan], [], [1e308] * 20)
ODD_KEYS = ("ratio/p99_by_staleness/²", "ratio/p99_by_staleness/-1", "ratio/p99_by_staleness/99999",
            "ratio/p99_by_staleness/", "staleness/hist/x")


def _exercise(m: Monitor, draw: bool = False) -> None:
    m.format_line()
    panels = m.renderable()  # every number is formatted here ...
    if draw:  # ... and laid out here (slower: once per case)
        m.console.print(panels)
        m.refresh(force=True)


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("live", [False, True], ids=["plain", "live"])
def test_hostile_values_never_crash_any_panel(value, live):
    con = recording_console(terminal=live)
    m = Monitor(cfg_with(run__max_steps=10, run__max_time_s=60.0, monitor__refresh_s=0.01),
                console=con, live=live)
    with m:
        m.update(run_records(2))  # a sane run first: every panel has something to show
        for key in RENDERED_KEYS + ODD_KEYS:  # one key at a time, then all together
            m.update([rec("learner", "0", 3, {key: value}), rec("actor", "9", 3, {key: value})])
            _exercise(m)
        _exercise(m, draw=True)
        m.update([rec("learner", "0", 4, dict.fromkeys(RENDERED_KEYS + ODD_KEYS, value))])
        _exercise(m, draw=True)
    assert m.records == len(run_records(2)) + 2 * len(RENDERED_KEYS + ODD_KEYS) + 1
    assert m.render_errors == 0  # nothing was caught by refresh's last-resort guard either


def test_hostile_sparkline_and_histogram_values_render_sensibly():
    assert sparkline([1.0, math.inf, 2.0, -math.inf, 3.0]) == "▁▄█"  # non-finite points skipped
    m = Monitor(Config(), console=recording_console(), live=False)
    m.update([rec("learner", "0", 1, {"staleness/hist": [math.inf, 2.0, -1.0, math.nan]})])
    assert "stale {0: inf, 1: 2, 2: -1}" in m.format_line()
    m.update([rec("actor", "0", 1, {"actor/version": 1e300})])
    assert m.actor_versions() == {}  # not a version number: not shown as one


def test_a_broken_panel_does_not_raise_out_of_refresh(monkeypatch):
    m = Monitor(Config(), console=recording_console(), live=False)
    m.update(run_records(1))
    monkeypatch.setattr(m, "format_line", lambda: 1 / 0)
    m.refresh(force=True)  # logged once, counted; the run goes on
    m.refresh(force=True)
    assert m.render_errors == 2


def test_a_pipeline_stage_leads_the_step_counter_and_the_length_limit_shows():
    m = Monitor(cfg_with(run__max_steps=150, run__stage="3/4 rl2 · sustain"), console=recording_console(), live=False)
    m.update(run_records() + [rec("actor", "0", 14, {"length/limit": 20.0})])
    assert "3/4 rl2 · sustain · step 14/150" in m.format_line() and "len 4.1 (limit 20)" in m.format_line()
    m.console.print(m.renderable())
    text = m.console.export_text()
    assert "3/4 rl2 · sustain · step 14/150" in text and "limit 20" in text


def test_the_discard_funnel_shows_in_the_line_and_the_dashboard(monitor):
    assert "funnel" not in monitor.format_line()  # nothing counted yet: no funnel shown
    monitor.update([rec("actor", "0", 15, {"funnel/generated": 30.0, "funnel/no_signal": 5.0}),
                    rec("buffer", "0", 15, {"funnel/accepted": 25.0, "funnel/stale_in_buffer": 2.0}),
                    rec("learner", "0", 15, {"funnel/trained": 20.0})])
    want = "generated 30 → accepted 25 → trained 20 · lost 7 (no signal 5, stale in buffer 2) · held 0"
    assert f"funnel {want}" in monitor.format_line()
    con = recording_console(width=140)
    con.print(monitor.renderable())
    assert want in con.export_text()
