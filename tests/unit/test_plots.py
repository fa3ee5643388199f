"""run.py plot on a synthetic metrics.jsonl, and the metrics follower's optional TensorBoard output
read back from its event files (the other consumer of the same records)."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest

pytest.importorskip("matplotlib")

from core import plots  # noqa: E402
from core.messages import MetricRecords  # noqa: E402
from core.metrics import record_to_json  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
T0 = 1_000_000.0


def rec(role, id, step, t, **values) -> MetricRecords:
    return MetricRecords(role=role, id=id, step=step, time=T0 + t,
                         values={k.replace("__", "/"): v for k, v in values.items()})


def synthetic_run() -> list[MetricRecords]:
    """12 learner steps a second apart, two actors, one eval, a learner restart at t = 6.2 s."""
    out = []
    for s in range(12):
        out.append(rec("learner", "learner", s, s, ratio__p50=1.0, ratio__p99=1.05 + s / 100, ratio__p999=1.2,
                       ratio__max=3.0 + s, learner__idle_frac=0.3, learner__tokens_per_s=900.0,
                       learner__samples_per_s=40.0, staleness__mean=0.5, staleness__max=2.0,
                       staleness__hist=[10.0 * s, 5.0 * s, float(s)], length__mean=6.0,
                       **{"ratio/p99_by_staleness/0": 1.01, "ratio/p99_by_staleness/1": 1.1}))
        for a in ("actor0", "actor1"):
            out.append(rec("actor", a, s, s + 0.5, reward__mean=0.1 * s, actor__tokens_per_s=500.0,
                           length__mean=6.0, length__max=9.0))
    out.append(rec("actor", "actor0", 5, 5.1, eval__reward=0.25))
    out.append(rec("launcher", "launcher", -1, 6.2, **{"run/restarts/learner": 1.0}))
    return out


def write_jsonl(run_dir, records, extra: bytes = b"") -> None:
    with open(run_dir / "metrics.jsonl", "wb") as f:
        f.write(b"".join(record_to_json(r) + b"\n" for r in records) + extra)


def test_restarts_land_on_the_learner_step_nearest_in_time():
    records = synthetic_run()
    assert plots.restart_steps(records) == [(6.0, "learner")]
    idx = plots.index(records)
    assert plots.merged(idx, "reward/mean")[3] == (3.0, pytest.approx(0.3))  # mean of two actors
    assert sorted(idx["actor/tokens_per_s"]) == ["actor/actor0", "actor/actor1"]


def test_plot_writes_every_figure_as_a_png(tmp_path, capsys):
    write_jsonl(tmp_path, synthetic_run(), extra=b"{torn")
    assert plots.main([str(tmp_path)]) == 0
    paths = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plots"]
    names = {os.path.basename(p) for p in paths}
    assert names == {"reward.png", "length.png", "ratio.png", "learner_idle.png", "staleness.png",
                     "ratio_by_staleness.png", "throughput.png"}
    for p in paths:
        assert os.path.dirname(p) == str(tmp_path / "plots")
        with open(p, "rb") as f:
            data = f.read()
        assert data.startswith(PNG) and len(data) > 10_000, p


def test_a_run_without_learner_or_actors_still_gets_every_figure(tmp_path, capsys):
    write_jsonl(tmp_path, [rec("buffer", "buffer", 0, t, buffer__depth=1.0) for t in range(3)])
    assert plots.main([str(tmp_path)]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plots"]) == 7


def test_a_missing_metric_is_drawn_as_not_logged():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2)
    idx = plots.index(synthetic_run())
    plots.line_panel(a, idx, "x", [("nope/a", "a"), ("nope/b", "b")], [])
    plots.line_panel(b, idx, "y", [("ratio/p99", "p99"), ("length/p99", "p99 length")], [(6.0, "learner")])
    plt.close(fig)
    assert "not logged" in a.texts[0].get_text() and "nope/b" in a.texts[0].get_text()
    assert len(b.lines) == 2  # the series and the restart line
    assert any("not logged: length/p99" in t.get_text() for t in b.texts)


def test_plot_of_a_missing_run_exits_2(tmp_path, capsys):
    assert plots.main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- TensorBoard: the follower's third output ---------------------------------------------------


def read_events(path: str) -> list:
    """The Event protos of one TFRecord file (length, crc, payload, crc per record)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        out.append(Event.FromString(data[pos + 12: pos + 12 + n]))
        pos += 12 + n + 4
    return out


def scalars(root: str) -> dict[tuple[str, str, int], float]:
    """``{(source dir, tag, step): value}`` of every event file under ``root``."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            for ev in read_events(os.path.join(d, name)):
                for v in ev.summary.value:
                    out[os.path.relpath(d, root), v.tag, ev.step] = v.simple_value
    return out


def test_tensorboard_events_carry_the_names_and_values_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboardX")
    from core import config as C
    from core.metrics import MetricsWriter, follower_for

    follower = follower_for(C.load(None, ["metrics.tensorboard=true"]), str(tmp_path))
    writers = [MetricsWriter(str(tmp_path), "learner", "learner"), MetricsWriter(str(tmp_path), "launcher", "launcher")]
    try:
        writers[0].emit(4, {"ratio/p99": 1.25, "ratio/p99_by_staleness/2": 1.5, "staleness/hist": [1, 2],
                            "learner/loss": math.nan})
        assert [r.role for r in follower.read()] == ["learner"]
        writers[1].emit(-1, {"run/restarts/actor0": 1.0})  # lands at the learner's step
        assert [r.role for r in follower.read()] == ["launcher"]
    finally:
        for w in writers:
            w.close()
        follower.close()
    jsonl = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    tb = scalars(str(tmp_path / "tensorboard"))
    expect = {}
    for row in jsonl:
        step = row["step"] if row["step"] >= 0 else 4
        for k, v in row.items():
            if k not in ("step", "time", "role", "id") and isinstance(v, float):
                expect[os.path.join(row["role"], row["id"]), k, step] = v
    assert ("learner/learner", "ratio/p99", 4) in expect and ("launcher/launcher", "run/restarts/actor0", 4) in expect
    assert tb.keys() == expect.keys()  # NaN (null) and the list are not written
    for key, v in expect.items():
        assert tb[key] == pytest.approx(v, rel=1e-6), key  # simple_value is a float32


def test_tensorboard_without_the_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    import sys

    from core import config as C
    from core.metrics import follower_for

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with pytest.raises(C.ConfigError, match=r"metrics.tensorboard.*pip install -e '\.\[tensorboard\]'"):
        follower_for(C.load(None, ["metrics.tensorboard=true"]), str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()  # raised before anything was opened
