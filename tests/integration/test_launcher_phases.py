"""SIGTERM in every phase of a launch (model build, contract check, role start, restart backoff,
shutdown) ends ``python run.py`` within a bound, exit 130, with every role stopped and reaped."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from core import config as C
from core import launchers
from tests.support.runs import ROOT, TINY_RUN, models_dir

BOUND_S = 30.0  # from SIGTERM to the launcher's exit, whatever it was doing


@pytest.fixture(scope="module")
def cache_dir():
    return models_dir()  # the tiny model, built once for all the whole-run tests


@pytest.fixture
def launch(tmp_path):
    """Start a :class:`Launch`; one a failed test left running is SIGKILLed (its roles follow it)."""
    runs = []
    yield lambda *overrides: runs.append(Launch(tmp_path, *overrides)) or runs[-1]
    for run in runs:
        if run.p.poll() is None:
            run.p.kill()
            run.p.wait()


class Launch:
    """``python run.py`` (the tiny job, in ``tmp_path``) with its output in a file to poll."""

    def __init__(self, tmp_path, *overrides):
        self.run_dir, self.out_path, self.pids = tmp_path / "run", tmp_path / "out.log", {}
        cmd = [sys.executable, "run.py", *TINY_RUN, "run.max_steps=100000", "run.max_time_s=300",
               f"run.run_dir={self.run_dir}", *overrides]
        with open(self.out_path, "wb") as out:
            self.p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def read_pids(self) -> dict:
        try:  # rewritten on every restart: a read may catch it half written
            self.pids.update({k: v for k, v in json.loads((self.run_dir / "pids.json").read_text()).items()
                              if k != "launcher"})
        except (OSError, ValueError):
            pass
        return self.pids

    def until(self, cond, what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert self.p.poll() is None, f"the run ended before {what}:\n{self.out()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f} s:\n{self.out()[-3000:]}"
            time.sleep(0.05)

    def sigterm(self, repeat_s: float = 0.0) -> float:
        """SIGTERM (again every ``repeat_s`` while it runs, if set); the seconds until it exited."""
        t0 = time.monotonic()
        self.p.send_signal(signal.SIGTERM)
        while self.p.poll() is None and time.monotonic() - t0 < BOUND_S:
            time.sleep(repeat_s or 0.05)
            if repeat_s and self.p.poll() is None:
                self.p.send_signal(signal.SIGTERM)
        took = time.monotonic() - t0
        print(f"the launcher exited {took:.1f} s after the first SIGTERM")
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"the launcher outlived a SIGTERM by {BOUND_S:.0f} s:\n{self.out()[-3000:]}")
        return took

    def assert_clean_exit(self, codes=(130,)) -> None:
        """Exit 130 with no traceback, no role process left (alive or zombie), none unlisted either."""
        left = {name: (pid, _state(pid)) for name, pid in self.read_pids().items() if _state(pid) is not None}
        assert not left, f"roles left behind (name: pid, state) {left}"
        assert not _children_of(self.p.pid), "a role started but not in pids.json outlived the launcher"
        out = self.out()
        assert self.p.returncode in codes and "Traceback" not in out and "interrupted" in out, out[-3000:]


def _lines(path) -> list[str]:
    """The complete lines of ``path`` so far (none before it exists)."""
    try:
        return path.read_text().split("\n")[:-1] if path.exists() else []  # the last: partial or empty
    except OSError:
        return []


def _state(pid: int) -> str | None:
    """The process state letter (Z: a zombie nobody reaped), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _children_of(launcher_pid: int) -> list[int]:
    """Processes started by that launcher (core/launchers/local.py gives each its pid in the environment)."""
    mark, found = f"DRIFTRL_LAUNCHER_PID={launcher_pid}\0".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_sigterm_during_model_build(tmp_path, launch):
    run = launch(f"model.cache_dir={tmp_path / 'models'}", "model.pretrain_steps=100000")
    run.until(lambda: "building the tiny base model (first use only): " in run.out(), "model build")
    run.sigterm()
    run.assert_clean_exit()
    assert not run.run_dir.exists() and os.listdir(tmp_path / "models") == [], "a half-built model left"


@pytest.mark.slow
def test_sigterm_during_contract_check(tmp_path, launch):
    big = ["model.hidden_size=512", "model.num_layers=6", "model.intermediate_size=2048", "model.num_heads=4",
           "model.num_kv_heads=2", "model.pretrain_steps=0"]  # untrained: built at once, checked for seconds
    run = launch(f"model.cache_dir={tmp_path / 'models'}", *big)
    run.until(lambda: "precision: " in run.out(), "contract check")
    run.sigterm()
    assert "INFO: contract check passed" not in run.out(), "the SIGTERM missed the contract check"
    run.assert_clean_exit()
    assert not run.run_dir.exists()


@pytest.mark.slow
def test_sigterm_during_role_start(tmp_path, cache_dir, launch):
    run = launch(f"model.cache_dir={cache_dir}")
    run.until(lambda: (run.run_dir / "logs" / "buffer.log").exists(), "role start")
    run.sigterm()
    run.assert_clean_exit()


@pytest.mark.slow
def test_sigterm_during_restart_backoff(tmp_path, cache_dir, launch):
    run = launch(f"model.cache_dir={cache_dir}", "run.restart_backoff_s=30")
    run.until(lambda: "actor0" in run.read_pids(), "pids.json")
    os.kill(run.pids["actor0"], signal.SIGKILL)
    run.until(lambda: "actor0 was killed by SIGKILL" in run.out() and "restarting (1/" in run.out(), "restart")
    took = run.sigterm()
    run.assert_clean_exit()
    assert took < 20, f"the launcher waited out the 30 s backoff ({took:.1f} s)"


@pytest.mark.slow
def test_sigterm_storm_during_shutdown(tmp_path, cache_dir, launch):
    """A SIGTERM, then another every 0.1 s, landing while the roles are being stopped (a second one
    used to break the stop off: the launcher left, its roles running or unreaped)."""
    run = launch(f"model.cache_dir={cache_dir}")
    metrics = run.run_dir / "metrics.jsonl"
    run.until(lambda: any(json.loads(line).get("role") == "learner" for line in _lines(metrics)), "a learner step")
    run.read_pids()
    run.sigterm(repeat_s=0.1)
    run.assert_clean_exit(codes=(130, -signal.SIGTERM))  # -SIGTERM: one that came in Python's teardown


def test_a_config_the_roles_could_not_read_fails_before_they_start(tmp_path):
    """A value past the checks that config.json cannot carry (inf is written as null) is refused when
    it is written, as one config error: no role starts only to die reading it, restart after restart."""
    cfg = C.load(None, TINY_RUN + ["model.path=/nonexistent"])
    bad = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner, lr=math.inf))
    with pytest.raises(C.ConfigError, match=r"learner\.lr") as e:
        launchers.prepare(bad, str(tmp_path / "run"))
    assert "\n" not in str(e.value)
    assert launchers.prepare(cfg, str(tmp_path / "run2"))[0].run.run_dir == str(tmp_path / "run2")
