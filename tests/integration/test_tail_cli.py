"""A real short run writes ``tail.jsonl`` (one line per step, learner/tail.py's fields), and
``python run.py tail RUN_DIR`` summarises it consistently with the file and with the learner's
own ratio metrics."""

import json
import os
import subprocess
import sys

import pytest

import jobs
from core import config as C
from learner.tail import RECORD_FIELDS, TAIL_FILE
from tests.support.runs import ROOT, TINY_RUN, lines, models_dir

STEPS, K = 4, 3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tail")
    cfg = C.load(None, TINY_RUN + [f"model.cache_dir={models_dir()}", "buffer.max_staleness=1",
                                   f"run.max_steps={STEPS}", "run.max_time_s=60", f"learner.tail_k={K}"])
    result = jobs.train(cfg, str(tmp / "run"))
    assert not result.interrupted
    return result.run_dir


def _tail(*args):
    return subprocess.run([sys.executable, "run.py", "tail", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_one_line_per_step_with_the_documented_fields(run_dir):
    steps = lines(os.path.join(run_dir, TAIL_FILE))
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    learner = {r["step"]: r for r in lines(os.path.join(run_dir, "metrics.jsonl")) if r["role"] == "learner"}
    for s in steps:
        recs = s["records"]
        assert s["version"] == s["step"] - 1 and s["k"] == K and 0 < len(recs) <= 2 * K
        assert all(list(r) == list(RECORD_FIELDS) for r in recs)
        assert all(0 <= r["position"] < r["length"] and 0 <= r["staleness"] <= 1 for r in recs)
        high = [r["ratio"] for r in recs if r["direction"] == "high"]
        if high:  # the step's largest ratio is the learner's own ratio/max (same log-probs)
            assert max(high) == pytest.approx(learner[s["step"]]["ratio/max"], rel=1e-6)
        assert high == sorted(high, reverse=True)


@pytest.mark.slow
def test_tail_command_summarises_the_file(run_dir):
    out = _tail(run_dir, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    recs = [r for line in lines(os.path.join(run_dir, TAIL_FILE)) for r in line["records"]]
    assert (s["steps"], s["records"]) == (STEPS, len(recs))
    assert sum(v["count"] for v in s["by_staleness"].values()) == len(recs)
    assert sum(v["count"] for v in s["by_position"].values()) == len(recs)
    assert s["high"][0]["ratio"] == max(r["ratio"] for r in recs if r["direction"] == "high")
    last = _tail(run_dir, "--json", "--last", "2")
    assert json.loads(last.stdout.strip().splitlines()[-1])["first_step"] == STEPS - 1
    text = _tail(run_dir)  # a pipe: plain aligned text
    assert text.returncode == 0 and "highest ratio" in text.stdout and "tail by staleness" in text.stdout


@pytest.mark.slow
def test_missing_run_dir_is_a_clear_error(tmp_path):
    out = _tail(str(tmp_path / "nope"))
    assert out.returncode != 0 and "does not exist" in out.stderr
    out = _tail(str(tmp_path))
    assert out.returncode != 0 and "has no tail.jsonl" in out.stderr
