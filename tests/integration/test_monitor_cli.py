"""``run.py monitor`` attached from another terminal (a real tmux pane) to a real running job:
the ratio p99 and the staleness panel update live, and killing the monitor does not disturb the
job; then the finished job is replayed, plotted (``run.py plot``), and, with tensorboardX
installed, its TensorBoard events carry the learner's metric names. An actor killed meanwhile
shows up as a restart in the view and in the plots."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.runs import ROOT, TINY_RUN, alive, lines, models_dir

STEPS = 60  # long enough (~15 s of learner steps here) to watch it move and detach mid-run
try:
    import tensorboardX  # noqa: F401

    TENSORBOARD = True
except ImportError:
    TENSORBOARD = False


class Job:
    def __init__(self, tmp):
        self.run_dir = str(tmp / "run")
        overrides = TINY_RUN + [f"model.cache_dir={models_dir()}", f"run.max_steps={STEPS}", "run.max_time_s=150",
                                f"run.run_dir={self.run_dir}", f"metrics.tensorboard={str(TENSORBOARD).lower()}"]
        self.log = open(tmp / "job.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "run.py", *overrides], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def learner_steps(self) -> int:
        recs = lines(os.path.join(self.run_dir, "metrics.jsonl")) if os.path.exists(self.run_dir) else []
        return max((r["step"] for r in recs if r["role"] == "learner"), default=-1)

    def finish(self, timeout: float = 180) -> int:
        rc = self.proc.wait(timeout)
        assert rc == 0, open(self.log.name, errors="replace").read()[-3000:]
        return rc


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("monitor"))
    yield j
    if j.proc.poll() is None:
        j.proc.terminate()
        try:
            j.proc.wait(30)
        except subprocess.TimeoutExpired:
            j.proc.kill()
            j.proc.wait()
    j.log.close()


class Tmux:
    """A private tmux server (its own socket), so nobody else's sessions are touched."""

    def __init__(self):
        self.sock = f"driftrl-test-{uuid.uuid4().hex[:8]}"

    def cmd(self, *args) -> str:
        # pytest exports COLUMNS=80 and LINES=24, which rich would believe over the pane's size
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        return subprocess.run(["tmux", "-L", self.sock, *args], capture_output=True, text=True, timeout=10,
                              check=True, env=env).stdout

    def screen(self) -> str:
        return self.cmd("capture-pane", "-p", "-t", "mon")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=10)


def wait_for(what, timeout: float, every: float = 0.3):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(every)
    return None


def readings(screen: str) -> tuple[int, str, float] | None:
    """(step, the ratio p99 row, staleness samples in all) of a drawn dashboard; None before."""
    step = re.search(r"step (\d+)/%d" % STEPS, screen)
    p99 = re.search(r"│ p99 +(\d+\.\d+)[^│]*", screen)
    counts = re.findall(r"│ +\d+ [█▉▊▋▌▍▎▏ ]+ +(\d+) ", screen)
    if not (step and p99 and counts and "staleness (mean" in screen):
        return None
    return int(step.group(1)), p99.group(0).strip(), float(sum(map(float, counts)))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_monitor_in_a_real_terminal_updates_live_and_detaching_leaves_the_job_alone(job):
    assert wait_for(lambda: job.learner_steps() >= 1 or job.proc.poll() is not None, 120)
    assert job.proc.poll() is None, "the job ended before the monitor could attach"
    launcher = json.load(open(os.path.join(job.run_dir, "pids.json")))["launcher"]
    tmux = Tmux()
    try:
        tmux.cmd("new-session", "-d", "-s", "mon", "-x", "160", "-y", "50",
                 f"{sys.executable} run.py monitor {job.run_dir}; sleep 600")
        first = wait_for(lambda: readings(tmux.screen()), 30)
        assert first, tmux.screen()
        os.kill(json.load(open(os.path.join(job.run_dir, "pids.json")))["actor0"], signal.SIGKILL)
        assert wait_for(lambda: "restarts 1 · last actor0" in tmux.screen(), 30), tmux.screen()
        second = wait_for(lambda: (r := readings(tmux.screen())) and r[0] > first[0] and r, 30)
        assert second, f"the step did not advance:\n{tmux.screen()}"
        assert second[1] != first[1]  # the p99 row (its value and sparkline) moved with the steps
        assert second[2] > first[2]  # the staleness histogram counts every sample trained since
        assert "attached" in tmux.screen()
        running = job.proc.poll() is None
    finally:
        tmux.kill()  # the monitor gets SIGHUP, like a closed terminal
    assert running, "the job finished before the monitor was detached: raise STEPS"
    time.sleep(1.0)
    assert job.proc.poll() is None and alive(launcher)  # detaching did not disturb it
    job.finish()


@pytest.mark.slow
def test_a_finished_job_is_replayed_plotted_and_in_tensorboard(job):
    job.finish()
    out = subprocess.run([sys.executable, "run.py", "monitor", job.run_dir, "--live", "off"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"step {STEPS}/{STEPS}" in out.stdout and "the job has ended" in out.stdout
    out = subprocess.run([sys.executable, "run.py", "plot", job.run_dir], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    paths = json.loads(out.stdout.strip().splitlines()[-1])["plots"]
    assert len(paths) == 7
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 10_000
    restarts = [r for r in lines(os.path.join(job.run_dir, "metrics.jsonl")) if "run/restarts/actor0" in r]
    from core.plots import load, restart_steps

    assert [role for _, role in restart_steps(load(job.run_dir))] == ["actor0"] * len(restarts)
    if TENSORBOARD:
        check_tensorboard(job.run_dir)


def check_tensorboard(run_dir: str) -> None:
    from tests.unit.test_plots import scalars

    tb = scalars(os.path.join(run_dir, "tensorboard"))
    learner = [r for r in lines(os.path.join(run_dir, "metrics.jsonl")) if r["role"] == "learner"]
    want = {r["step"]: r["ratio/p99"] for r in learner if isinstance(r.get("ratio/p99"), float)}
    src = f"learner/{learner[0]['id']}"
    got = {step: v for (where, tag, step), v in tb.items() if where == src and tag == "ratio/p99"}
    assert got.keys() == want.keys() and len(got) >= STEPS // 2
    assert all(got[s] == pytest.approx(v, rel=1e-6) for s, v in want.items())  # stored as float32
