"""Pure parts of the end-to-end benches (bench/common.py, bench/vs_trl.py): the arithmetic that
turns metrics.jsonl into the reported figures, and the TRL adapters that must agree with driftrl
(prompt ids, reward), on the real tokenizer and task. No timing assertions. (bench/buffer.py's
end-to-end run lives in tests/integration/test_bench_buffer.py.)"""

import json
import math
import random
import time

import pytest

from actor.tasks.arith import tokenizer_files
from bench.common import (
    final_reward, format_table, json_safe, ratio, read_metrics, reward_at, summarize_run, time_to_threshold,
    version_times,
)
from bench.vs_trl import check_prompt_ids, make_reward, prompt_text
from tests.support.tiny import tiny_task


def _learner(step, wait, busy, publish=0.001, stale=1.0):
    return {"step": step, "time": 100.0 + step, "role": "learner", "id": "learner0", "learner/step": float(step),
            "learner/version": float(step), "learner/wait_s": wait, "learner/step_s": busy,
            "weightsync/publish_s": publish, "staleness/mean": stale, "time/elapsed_s": step * (wait + busy)}


def _actor(ident, adm, buf_cum, apply_s=0.002):
    return {"step": 0, "time": 0.0, "role": "actor", "id": ident, "actor/admission_wait_s": adm,
            "actor/buffer_wait_s": buf_cum, "weightsync/apply_s": apply_s}


def test_summary_counts_samples_idle_and_breakdown():
    recs = [_learner(s, wait=0.1, busy=0.3) for s in (1, 2, 3, 4)]
    recs += [_actor("actor0", 0.2, 0.1), _actor("actor0", 0.2, 0.3)]
    recs.append({"role": "buffer", "id": "buffer", "buffer/depth": 3.0})
    s = summarize_run(recs, groups_per_step=16, group_size=8)
    assert s["steps"] == 4 and s["samples"] == 4 * 128
    assert s["train_wall_s"] == pytest.approx(1.6)
    assert s["samples_per_s"] == pytest.approx(512 / 1.6)
    assert s["learner_idle_frac"] == pytest.approx(0.25)
    assert s["learner_compute_s"] == pytest.approx(4 * 0.299)
    # admission waits summed, buffer wait is cumulative: the last value, not the sum
    assert s["actor_idle_frac"] == pytest.approx((0.4 + 0.3) / 1.6)
    assert s["actor_gen_s"] == pytest.approx(1.6 - 0.7)
    assert s["weightsync_apply_s_est"] == pytest.approx(4 * 0.002)
    assert s["staleness_mean"] == 1.0


def test_summary_reports_the_learners_highest_peak_memory_and_none_without_it():
    recs = [{**_learner(s, 0.1, 0.3), "learner/peak_rss_mb": peak, "learner/shm_mb": shm}
            for s, peak, shm in ((1, 900.0, 500.0), (2, 1500.0, 1000.0), (3, 1200.0, 1000.0))]
    s = summarize_run(recs, 4, 2)
    assert (s["learner_peak_rss_mb"], s["learner_shm_mb"]) == (1500.0, 1000.0)
    assert summarize_run([_learner(1, 0.1, 0.3)], 4, 2)["learner_peak_rss_mb"] is None  # an older run's metrics


def test_summary_averages_actor_idle_over_actors_and_ignores_record_order():
    recs = [_learner(s, 0.0, 0.5) for s in (2, 1)] + [_actor("actor0", 0.5, 0.0), _actor("actor1", 0.0, 0.0)]
    s = summarize_run(recs, 4, 2)
    assert s["steps"] == 2 and s["train_wall_s"] == 1.0
    assert s["actor_idle_frac"] == pytest.approx(0.25)
    assert s["learner_idle_frac"] == 0.0


def test_time_axis_starts_at_the_first_step_not_at_the_launch():
    """``time/elapsed_s`` counts from the launch (start-up included); the bench's axis and
    wall time start where the first step began, as TRL's start at on_train_begin."""
    recs = [_learner(s, wait=0.1, busy=0.3) for s in (1, 2, 3, 4)]
    for r in recs:
        r["time/elapsed_s"] += 7.25  # the learner took 7.25 s to start
    assert version_times(recs) == pytest.approx({1: 0.4, 2: 0.8, 3: 1.2, 4: 1.6})
    assert summarize_run(recs, 16, 8)["train_wall_s"] == pytest.approx(1.6)


def test_summary_refuses_a_run_without_steps():
    with pytest.raises(ValueError, match="no learner step"):
        summarize_run([_actor("actor0", 1.0, 0.0)], 16, 8)


def test_metrics_file_round_trip_final_reward_and_version_times(tmp_path):
    recs = [_learner(1, 0.0, 1.0), _learner(2, 0.0, 1.0),
            {"role": "actor", "id": "actor0", "eval/reward": 0.3},
            {"role": "launcher", "id": "final_eval", "eval/reward": 0.6, "eval/final": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + "\n")
    got = read_metrics(str(tmp_path))
    assert got == recs
    assert final_reward(got) == 0.6
    assert final_reward(got[:3]) is None
    assert version_times(got) == {1: 1.0, 2: 2.0}


def test_threshold_and_reward_at_on_unsorted_curves():
    curve = [(20.0, 0.5), (0.0, 0.2), (10.0, 0.45), (30.0, 0.4)]
    assert time_to_threshold(curve, 0.45) == 10.0
    assert time_to_threshold(curve, 0.9) is None
    assert reward_at(curve, 25.0) == 0.5
    assert reward_at(curve, 30.0) == 0.4
    assert reward_at(curve, -1.0) is None


def test_ratio_table_and_json_safety():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(math.nan, 1.0) is None
    table = format_table(["name", "value"], [["a", 1.23456], ["long-name", None], ["c", math.nan]]).splitlines()
    assert len(table) == 5 and len({len(line) for line in table}) == 1  # aligned columns
    assert "1.235" in table[2] and table[3].rstrip().endswith("–") and "nan" in table[4]
    assert json.loads(json.dumps(json_safe({"x": [math.nan, 1.0], "y": {"z": math.inf}}))) == {
        "x": [None, 1.0], "y": {"z": None}}


def test_trl_reward_matches_the_task_reward_on_token_ids():
    task = tiny_task()
    tok = task.tok
    reward = make_reward(task)
    good = tok.encode("85") + [tok.eos_id]
    ids = [[tok.bos_id, *tok.encode("47+38=")]] * 3 + [[tok.bos_id, *tok.encode("40+38=")]]
    got = reward(prompts=["<s>47+38="] * 4, completions=["85", "58", "85", "8"],
                 completion_ids=[good, tok.encode("58") + [tok.eos_id], tok.encode("85"), good],
                 ids=ids, answer=["85", "85", "85", "78"], trainer_state=None)
    assert got == [1.0, 0.0, 0.0, 0.0]  # wrong digits, missing EOS, wrong problem


def test_hf_tokenizer_encodes_trl_prompts_to_driftrl_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name, data in tokenizer_files().items():
        (tmp_path / name).write_bytes(data)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    task, rng = tiny_task(), random.Random(0)
    prompts = [task.sample(rng) for _ in range(50)]
    texts, ids = [prompt_text(task, p) for p in prompts], [list(p.tokens) for p in prompts]
    assert texts[0].startswith("<s>") and texts[0].endswith("=")
    check_prompt_ids(tok, texts, ids)
    with pytest.raises(AssertionError, match="encodes"):
        check_prompt_ids(tok, [t[3:] for t in texts], ids)  # without the BOS text


def test_async_bench_reports_the_median_repeat_with_the_spread():
    from bench.async_vs_sync import median_run

    reps = [{"samples_per_s": v, "final_reward": r} for v, r in ((900.0, 0.5), (1100.0, 0.6), (1000.0, 0.7))]
    got = median_run(reps)
    assert got["samples_per_s"] == 1000.0 and got["final_reward"] == 0.7
    assert got["samples_per_s_all"] == [900.0, 1100.0, 1000.0] and got["final_reward_all"] == [0.5, 0.6, 0.7]
    assert median_run(reps[:2])["samples_per_s"] == 900.0  # even count: the lower middle, never an average


def test_cpu_meter_attributes_own_work_to_own_cores():
    from bench.common import CpuMeter

    with CpuMeter() as cpu:
        t = time.process_time()
        spins = 0
        while time.process_time() - t < 0.3:  # 0.3 s of this process's CPU
            spins += 1
    r = cpu.result
    assert r["own_cpu_s"] >= 0.29  # the loop's CPU time is ours, however loaded the machine is
    assert r["own_cores"] == pytest.approx(r["own_cpu_s"] / r["wall_s"])
    assert r["foreign_cores"] >= 0.0 and r["machine_cores"] >= 0.0


def test_vs_trl_gives_both_sides_one_recipe_and_one_precision():
    from bench.vs_trl import parse_args, shared_overrides
    from core.precision import choose

    got = shared_overrides(parse_args(["--model", "/m", "--task", "math", "--precision", "float32",
                                       "-o", "actor.group_size=4"]))
    assert {"model.path=/m", "task.name=math", "learner.body_dtype=float32", "actor.dtype=float32"} <= set(got)
    assert got[-1] == "actor.group_size=4"  # the user's overrides come last: they win
    auto = shared_overrides(parse_args([]))
    assert f"learner.body_dtype={choose('auto', 'cpu')[0]}" in auto  # what driftrl picks here, for both sides
    assert not any(o.startswith(("model.path=", "task.name=")) for o in auto)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trl_trains_in_the_precision_driftrl_was_given(dtype, tmp_path):
    pytest.importorskip("trl")
    from bench.common import bench_config
    from bench.vs_trl import trl_args

    args = trl_args(bench_config([f"learner.body_dtype={dtype}"]), str(tmp_path), 10.0)
    assert args.bf16 is (dtype == "bfloat16") and not args.fp16
    assert args.model_init_kwargs == {"dtype": "float32"}  # FP32 master weights, as driftrl's learner keeps
