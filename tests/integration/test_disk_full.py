"""A full disk under the checkpoints: the learner stops with one clear line and exit status 75,
the launcher reports it in one line, nothing torn is left, and the run resumes once there is
space, training every group the buffer acknowledged exactly once (key by key: tests/support/books.py).
The disk is a 16 KiB tmpfs mounted on RUN_DIR/checkpoints (skipped where mounting is not
permitted)."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from core.proc import EXIT_WRITE_FAILED
from learner import audit
from tests.support import books
from tests.support.runs import models_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "model.pretrain_steps=40", "learner.groups_per_step=4",
        "actor.group_size=4", "actor.groups_per_batch=2", "run.eval_every=0", "monitor.live=off",
        "buffer.max_staleness=1", "run.ckpt_every=2", "run.max_time_s=150"]


@pytest.fixture
def small_disk(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(ckpts)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN)")
    yield ckpts
    subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)


def _run(*args):
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_full_disk_is_one_line_and_the_run_resumes(tmp_path, small_disk):
    run_dir = tmp_path / "run"
    cache = f"model.cache_dir={models_dir()}"  # the tiny model, built once for all the whole-run tests
    out = _run(*TINY, cache, "run.max_steps=6", f"run.run_dir={run_dir}")
    text = out.stdout + out.stderr
    assert out.returncode == EXIT_WRITE_FAILED, text[-3000:]  # the exit status says "could not write"
    assert "Traceback" not in text
    failed = [line for line in text.splitlines() if line.startswith("run failed")]
    assert len(failed) == 1 and "No space left on device" in failed[0], text[-3000:]
    assert "checkpoint" in failed[0] and str(small_disk) in failed[0] and "resume" in failed[0]
    with open(run_dir / "logs" / "learner.log") as f:
        log = f.read()
    assert f"(exit {EXIT_WRITE_FAILED})" in log and "Traceback" not in log
    assert os.listdir(small_disk) == []  # no torn checkpoint, no temporary directory

    before = [s["step"] for s in audit.read(run_dir / audit.TRAINED)]
    assert before and before == list(range(1, len(before) + 1)) and len(before) < 6, before  # stopped early

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed_at = time.time()  # the first buffer has stopped: its metrics records are all older
    out = _run("resume", str(run_dir), "run.max_steps=6")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    # no checkpoint survived the full disk: the resumed learner starts from the initial weights, every
    # step trained before the failure is cut from the audit and its groups served again (or dropped,
    # counted); then key by key, across both buffer processes: steps 1..6, nothing trained twice, every
    # acknowledged group trained once, still resident, or dropped as stale / rolled back
    counts = books.check(str(run_dir), 6, split_at=(resumed_at,))
    assert counts["buffer_incarnations"] == 2 and counts["steps_cut"] == len(before), (counts, before)
    cut = {tuple(k) for s in audit.read(run_dir / audit.ROLLED_BACK) for k in s["keys"]}
    assert len(cut) == 4 * len(before)  # learner.groups_per_step groups a step, all served again or dropped
    print(f"full disk after steps {before}; books after resume: {counts}")
