"""``python run.py pipeline`` end to end on a tiny scratch model, interrupted inside stage 2 and
resumed: rl1 and the distillation are not run again (their files are untouched), rl2 continues
from its own checkpoint without training a step twice, and the final tier table is the last line."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

from safetensors.torch import load_file

import run
from core.plots import write_plots
from learner import checkpoint
from tests.support.runs import ROOT, TINY_RUN, lines

# over configs/pipeline.toml (the default): 1- and 2-digit quotients answered directly, which a
# 32-wide model built in 150 steps gets right ~7 % of the time (measured: 0.13 with one quotient
# digit, 0.03 with two), so 32 prompts x 8 samples leave a corpus
TINY_PIPELINE = [*TINY_RUN, "task.name=scratch", "task.min_digits=1", "task.digits=2",
                 "model.pretrain_steps=150", "model.pretrain_batch=64", "model.pretrain_worked_frac=0.0",
                 "actor.max_new_tokens=12", "actor.dtype=float32", "learner.body_dtype=float32",
                 "actor.length_start=6", "actor.length_every=2", "run.max_time_s=0", "run.ckpt_every=2",
                 "run.eval_prompts=32", "distill.prompts=32", "distill.samples=8", "distill.epochs=1",
                 "pipeline.rl1.run.max_steps=4", "pipeline.rl2.run.max_steps=12", "pipeline.tiers.run.max_steps=2",
                 'pipeline.tiers.task.system_prompt={low="l ", medium="m ", high="h "}',
                 "pipeline.tiers.task.tier_max_new_tokens={low=8, medium=10, high=12}"]


def _digest(root: str) -> dict[str, str]:
    """sha256 of every file under ``root``: what a re-run stage would change."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _wait_for_rl2_checkpoint(proc, out: str, timeout_s: float = 240) -> None:
    ckpts = os.path.join(out, "rl2", "checkpoints")
    t0 = time.time()
    while not (os.path.isdir(ckpts) and any(n.startswith("step_") for n in os.listdir(ckpts))):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() - t0 < timeout_s, "rl2 wrote no checkpoint"
        time.sleep(0.2)


def test_pipeline_interrupted_in_stage_2_resumes_there_and_ends_with_the_tier_table(tmp_path, capsys):
    out = str(tmp_path / "pipe")
    cmd = [sys.executable, "run.py", "pipeline", "--out", out, "--k", "2", f"model.cache_dir={tmp_path / 'models'}",
           *TINY_PIPELINE]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_rl2_checkpoint(proc, out)
    done_before = {s: _digest(os.path.join(out, s)) for s in ("rl1", "distill")}
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and f"--resume {out}" in text, text[-3000:]
    state = json.load(open(os.path.join(out, "pipeline.json")))
    assert [state["stages"][s]["status"] for s in ("rl1", "distill", "rl2")] == ["done", "done", "running"]
    assert {s: _digest(os.path.join(out, s)) for s in ("rl1", "distill")} == done_before

    res = subprocess.run([sys.executable, "run.py", "pipeline", "--resume", out], cwd=ROOT, capture_output=True,
                         text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert {s: _digest(os.path.join(out, s)) for s in ("rl1", "distill")} == done_before  # never re-run
    steps = [s["version"] for s in lines(os.path.join(out, "rl2", "trained_keys.jsonl"))]
    assert steps == list(range(1, 13))  # rl2 went on from its checkpoint: every step once
    with open(os.path.join(out, "rl2", "logs", "learner.log")) as f:
        assert "resumed from" in f.read()
    # ... with its saved optimiser state, not a fresh one: AdamW counted every step of the stage
    optim = load_file(os.path.join(checkpoint.latest(os.path.join(out, "rl2", "checkpoints")), "optim.safetensors"))
    counts = {float(v) for k, v in optim.items() if k.endswith(".step")}
    assert counts == {12.0}, counts
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(report["tiers"]) == {"low", "high"}  # 1 and 2 quotient digits: difficulty 0 and 1
    for row in report["tiers"].values():
        assert 0 <= row["accuracy"] <= 1 and 0 < row["mean_length"] <= 12
    assert report["tiers"]["low"]["mean_length"] <= 8  # the low tier's own limit
    assert set(report["stages"]) == {"base", "rl1", "distill", "rl2", "tiers"}
    corpus = json.load(open(os.path.join(out, "distill", "corpus.json")))
    assert corpus["prompts"] == 32 and corpus["corpus"] >= 1
    ran = json.load(open(os.path.join(out, "pipeline.json")))
    assert all(ran["stages"][s]["status"] == "done" for s in ("rl1", "distill", "rl2", "tiers"))
    tiers_cfg = json.load(open(os.path.join(out, "tiers", "config.json")))
    assert tiers_cfg["task"]["system_prompt"]["low"] == "l " and tiers_cfg["learner"]["norm"] == "sample"

    # the same table from `run.py eval DIR --tiers`, the pipeline directory standing for its last stage
    capsys.readouterr()
    assert run.main(["eval", out, "--tiers", "--k", "2"]) == 0
    printed = capsys.readouterr().out
    table = json.loads(printed.strip().splitlines()[-1])
    assert set(table["tiers"]) == {"low", "high"} and table["checkpoint"] == os.path.join(out, "tiers", "final_model")
    assert "low     accuracy" in printed
    assert write_plots(out) == [os.path.join(out, "plots", "pipeline.png")]  # `run.py plot DIR`


def test_a_bad_stage_key_is_a_config_error_before_anything_is_built(tmp_path):
    res = subprocess.run([sys.executable, "run.py", "pipeline", "--out", str(tmp_path / "p"),
                          f"model.cache_dir={tmp_path / 'models'}", "pipeline.rl2.learner.nrom=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "`$.pipeline.rl2.learner.nrom`" in res.stderr, res.stderr[-2000:]
    assert not os.path.exists(tmp_path / "models") and not os.path.exists(tmp_path / "p")
