"""``run.py sweep`` logic without trainings: axes, the grid, per-run numbers from metrics
records, aggregation over seeds, the seed-spread rule, the table and the JSON."""

import json
import math
import os

import pytest

import sweep
from core import config as C


def _plan(tokens, seeds=(0,), minutes=None, out="/tmp/unused-sweep"):
    return sweep.make_plan(list(tokens), list(seeds), minutes, None, out)


# ---- parsing ---------------------------------------------------------------------------------


def test_split_values_keeps_lists_and_quoted_commas_together():
    assert sweep.split_values("0,1, 2") == ["0", "1", "2"]
    assert sweep.split_values("[0.9,0.99],[0.8,0.95]") == ["[0.9,0.99]", "[0.8,0.95]"]
    assert sweep.split_values('"a,b",c') == ['"a,b"', "c"]


def test_a_token_is_an_axis_or_a_fixed_override():
    assert sweep.parse_token("buffer.max_staleness=0,1,2") == sweep.Axis("buffer.max_staleness", ("0", "1", "2"))
    assert sweep.parse_token("learner.betas=[0.9,0.99]") == "learner.betas=[0.9,0.99]"
    assert sweep.parse_token("run.max_steps=5") == "run.max_steps=5"


@pytest.mark.parametrize("token, words", [
    ("buffer.max_staleness=", "empty value list"),
    ("buffer.max_staleness=0,,2", "empty value"),
    ("buffer.max_staleness=0,1,", "empty value"),
    ("buffer.max_staleness=1,1", "repeated"),
    ("=0,1", "not section.key=value"),
    ("max_staleness", "not section.key=value"),
])
def test_bad_tokens_are_named(token, words):
    with pytest.raises(sweep.SweepError) as e:
        sweep.parse_token(token)
    assert repr(token) in str(e.value) and words in str(e.value)


def test_unknown_key_is_rejected_by_the_config_loader_before_any_training():
    plan = _plan(["buffer.nosuch=0,1"])
    with pytest.raises(C.ConfigError) as e:
        sweep.configs(plan)
    assert "unknown config key `$.buffer.nosuch`" in str(e.value) and "buffer.nosuch=0" in str(e.value)


def test_bad_value_is_rejected_with_its_field_path():
    with pytest.raises(C.ConfigError, match=r"\$\.buffer\.max_staleness"):
        sweep.configs(_plan(["buffer.max_staleness=1,-1"]))


@pytest.mark.parametrize("tokens, minutes, words", [
    (["run.seed=0,1"], None, "--seeds"),
    (["buffer.max_staleness=0,1", "run.run_dir=x"], None, "--out"),
    (["buffer.max_staleness=0,1", "run.max_time_s=5"], 1.0, "--minutes"),
    (["buffer.max_staleness=0,1", "buffer.max_staleness=3"], None, "more than once"),
    (["run.max_steps=5"], None, "nothing to sweep"),
])
def test_plan_conflicts_are_named(tokens, minutes, words):
    with pytest.raises(sweep.SweepError, match=words):
        _plan(tokens, minutes=minutes)


def test_seeds():
    assert sweep.parse_seeds(None, None) == [0]
    assert sweep.parse_seeds(3, None) == [0, 1, 2]
    assert sweep.parse_seeds(None, "7,3") == [7, 3]
    for seeds, seed_list, words in ((0, None, "--seeds"), (None, "1,x", "'1,x'"), (None, "1,1", "repeated")):
        with pytest.raises(sweep.SweepError, match=words):
            sweep.parse_seeds(seeds, seed_list)
    with pytest.raises(SystemExit):  # argparse: not both
        sweep.parse(["a.b=0,1", "--seeds", "2", "--seed-list", "1"])


def test_cartesian_product_seed_major_with_unique_names():
    plan = _plan(["buffer.max_staleness=0,2", "learner.lr=1e-4,3e-4,1e-3", "run.max_steps=5"], seeds=(0, 1))
    runs = plan.runs()
    settings = [s for s, _, _ in runs[:6]]
    assert len(set(settings)) == 6 and settings == [s for s, _, _ in runs[6:]]
    assert settings[0] == (("buffer.max_staleness", "0"), ("learner.lr", "1e-4"))
    assert settings[-1] == (("buffer.max_staleness", "2"), ("learner.lr", "1e-3"))
    assert [seed for _, seed, _ in runs] == [0] * 6 + [1] * 6  # every setting's first seed first
    assert len({name for _, _, name in runs}) == 12
    cfgs = sweep.configs(plan)
    assert {(c.buffer.max_staleness, c.learner.lr, c.run.seed) for *_, c in cfgs} == {
        (s, lr, seed) for s in (0, 2) for lr in (1e-4, 3e-4, 1e-3) for seed in (0, 1)}
    assert all(c.run.max_steps == 5 for *_, c in cfgs)


def test_minutes_set_the_time_budget_and_lift_the_step_budget_unless_given():
    cfg = sweep.configs(_plan(["buffer.max_staleness=0,1"], minutes=1.5))[0][3]
    assert cfg.run.max_time_s == 90.0 and cfg.run.max_steps == 0
    cfg = sweep.configs(_plan(["buffer.max_staleness=0,1", "run.max_steps=7"], minutes=1.5))[0][3]
    assert cfg.run.max_time_s == 90.0 and cfg.run.max_steps == 7


def test_plan_round_trips_and_resume_takes_only_the_directory(tmp_path):
    ns = sweep.parse(["buffer.max_staleness=0,1", "run.max_steps=5", "--seeds", "2", "--out", str(tmp_path / "s")])
    new = sweep.load_plan(ns)
    sweep.save_plan(new)
    assert sweep.load_plan(sweep.parse(["--resume", str(tmp_path / "s")])) == new
    with pytest.raises(sweep.SweepError, match="already holds a sweep"):  # its results belong to that plan
        sweep.load_plan(ns)
    with pytest.raises(sweep.SweepError, match="drop seeds"):
        sweep.load_plan(sweep.parse(["--resume", str(tmp_path / "s"), "--seeds", "3"]))
    with pytest.raises(sweep.SweepError, match="no plan.json"):
        sweep.load_plan(sweep.parse(["--resume", str(tmp_path)]))


# ---- one run's numbers -----------------------------------------------------------------------


def _learner_rec(step, wait, busy, p99, stale_drops=0.0):
    return {"role": "learner", "step": step, "learner/step": float(step), "learner/wait_s": wait,
            "learner/step_s": busy, "learner/dropped_stale": stale_drops,
            **{f"ratio/p99_by_staleness/{s}": v for s, v in p99.items()}}


def test_summarise_reads_the_metric_names():
    recs = [_learner_rec(1, 3.0, 1.0, {0: 1.1}),
            {"role": "buffer", "buffer/dropped_stale": 2.0},
            _learner_rec(2, 1.0, 1.0, {0: 1.3, 1: 2.0}, stale_drops=1.0),
            {"role": "actor", "eval/reward": 0.5},
            _learner_rec(3, 0.0, 2.0, {1: None}, stale_drops=1.0),
            {"role": "buffer", "buffer/dropped_stale": 5.0}]
    out = sweep.summarise(recs, samples_per_step=16)
    assert out["steps"] == 3 and out["samples"] == 48
    # from step 2 on: the first step's 3 s wait is the actors' start-up
    assert out["steady_s"] == pytest.approx(4.0)
    assert out["samples_per_s"] == pytest.approx(32 / 4.0)
    assert out["idle_frac"] == pytest.approx(1.0 / 4.0)
    assert out["ratio_p99_by_lag"] == {"0": pytest.approx(1.2), "1": pytest.approx(2.0)}
    assert out["drops"] == {"buffer_stale": 5.0, "learner_stale": 1.0, "total": 6.0}


def test_summarise_without_a_step():
    out = sweep.summarise([{"role": "buffer", "buffer/dropped_stale": 1.0}], 16)
    assert out["steps"] == 0 and out["samples_per_s"] is None and out["ratio_p99_by_lag"] == {}
    one = sweep.summarise([_learner_rec(1, 3.0, 1.0, {0: 1.1})], 16)  # a lone step has no steady state
    assert one["steps"] == 1 and one["samples_per_s"] is None and one["idle_frac"] is None


# ---- aggregation and the spread rule ----------------------------------------------------------


def _result(s, seed, reward, sps, p99=None):
    return {"label": f"buffer.max_staleness={s}", "setting": {"buffer.max_staleness": s}, "seed": seed,
            "reward_final": reward, "reward_start": 0.05, "samples_per_s": sps, "idle_frac": 0.5,
            "steps": 10, "drops": {"total": float(s)}, "ratio_p99_by_lag": p99 or {"0": 1.1}, "wall_s": 50.0}


def _results():
    """Three settings, two seeds: 1 is best, 0 is close to it, 4 is clearly worse."""
    rewards = {0: (0.45, 0.55), 1: (0.50, 0.60), 4: (0.10, 0.20)}
    speed = {0: 20.0, 1: 30.0, 4: 40.0}
    p99 = {s: {seed: {"0": 1.0 + 0.1 * seed, **({str(s): 1.0 + s} if s else {})} for seed in (0, 1)}
           for s in (0, 1, 4)}
    return [_result(s, seed, rewards[s][seed], speed[s] + seed, p99[s][seed]) for seed in (0, 1) for s in (0, 1, 4)]


def test_aggregate_means_and_spread_over_seeds():
    rows = {r["label"]: r for r in sweep.aggregate(_results())}
    r = rows["buffer.max_staleness=0"]
    assert r["runs"] == 2 and r["seeds"] == [0, 1]
    assert r["reward_final"]["mean"] == pytest.approx(0.5)
    assert r["reward_final"]["std"] == pytest.approx(math.sqrt(2 * 0.05 ** 2))
    assert (r["reward_final"]["min"], r["reward_final"]["max"]) == (0.45, 0.55)
    assert r["samples_per_s"] == pytest.approx(20.5)
    assert r["ratio_p99_by_lag"] == {"0": pytest.approx(1.05)}  # the mean of the seeds' 1.0 and 1.1
    assert rows["buffer.max_staleness=4"]["ratio_p99_by_lag"] == {"0": pytest.approx(1.05), "4": pytest.approx(5.0)}


def test_the_spread_rule_tells_seed_noise_from_a_real_difference():
    rows = {r["label"]: r for r in sweep.aggregate(_results())}
    assert rows["buffer.max_staleness=1"]["vs_best"]["verdict"] == "best"
    close, far = rows["buffer.max_staleness=0"]["vs_best"], rows["buffer.max_staleness=4"]["vs_best"]
    pooled = math.sqrt(2 * 0.05 ** 2)  # every setting's std here
    assert close["pooled_std"] == pytest.approx(pooled) and far["pooled_std"] == pytest.approx(pooled)
    assert close["diff"] == pytest.approx(-0.05) and close["verdict"] == "within spread"
    assert far["diff"] == pytest.approx(-0.4) and far["verdict"] == "worse beyond spread"
    assert far["paired_diffs"] == {"0": pytest.approx(-0.4), "1": pytest.approx(-0.4)}  # seed by seed
    # the fastest setting not worse than the best: 1 (30.5/s) beats 0 (20.5/s); 4 is excluded
    assert sweep.choice(list(rows.values()))["label"] == "buffer.max_staleness=1"


def test_one_seed_leaves_the_spread_unknown():
    rows = sweep.aggregate([r for r in _results() if r["seed"] == 0])
    assert all(r["reward_final"]["std"] is None for r in rows)
    assert {r["vs_best"]["verdict"] for r in rows} == {"best", "spread unknown"}
    assert sweep.choice(rows) is None
    assert "spread unknown" in sweep.render(rows)


# ---- table and JSON --------------------------------------------------------------------------


def test_table_has_one_row_per_setting_and_a_column_per_lag():
    rows = sweep.aggregate(_results())
    lines = sweep.render(rows).splitlines()
    head = lines[0].split()
    for col in ("samples/s", "p99@0", "p99@1", "p99@4", "drops", "idle", "steps"):
        assert col in head
    assert "p99@2" not in head
    assert sum(line.startswith("buffer.max_staleness=") for line in lines) == 3
    assert any(line.startswith("rule:") and "2 x pooled std" in line for line in lines)
    assert lines[-1].startswith("pick: buffer.max_staleness=1")


def test_report_is_strict_json_with_the_table_and_every_run(tmp_path):
    plan = _plan(["buffer.max_staleness=0,1,4"], seeds=(0, 1), out=str(tmp_path))
    rep = sweep.report(plan, _results(), [], False, 12.0)
    back = json.loads(json.dumps(rep, allow_nan=False))
    assert back["planned"] == 6 and back["finished"] == 6 and back["interrupted"] is False
    assert back["wall_s"] == 12.0 and back["runs_wall_s"] == 6 * 50.0
    assert [s["label"] for s in back["settings"]] == [f"buffer.max_staleness={s}" for s in (0, 1, 4)]
    assert back["lags"] == ["0", "1", "4"] and back["pick"] == "buffer.max_staleness=1"
    assert {"mean", "std", "min", "max", "values"} <= set(back["settings"][0]["reward_final"])
    assert "2 x pooled std" in back["rule"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = sweep.plot(sweep.aggregate(_results()), str(tmp_path / "sweep.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---- resume ----------------------------------------------------------------------------------


def test_finished_trainings_are_taken_from_their_result_json(tmp_path):
    plan = _plan(["buffer.max_staleness=0,1"], out=str(tmp_path))
    todo = sweep.configs(plan)
    for (setting, seed, name, _), res in zip(todo, _results()):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "result.json").write_text(json.dumps(res))
    results, failed, interrupted = sweep.execute(plan, todo)  # nothing to train: no job starts
    assert [r["reward_final"] for r in results] == [0.45, 0.50] and not failed and not interrupted


def test_an_unfinished_training_is_moved_aside(tmp_path):
    run_dir = tmp_path / "00-max_staleness=0-seed0"
    for n in range(2):
        os.makedirs(run_dir / "checkpoints")
        sweep.move_aside(str(run_dir))
    assert not run_dir.exists()
    assert sorted(os.listdir(tmp_path)) == [f"{run_dir.name}.interrupted", f"{run_dir.name}.interrupted-2"]
