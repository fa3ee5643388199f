"""Role-process plumbing: private files, and no role outliving its launcher even when its own
wait ignores the stop flag."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from tests.support.runs import alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def _env(**extra):
    return {**os.environ, "PYTHONPATH": ROOT, **extra}


def test_files_a_role_creates_are_private(tmp_path):
    path = tmp_path / "secret"
    code = f"from core.proc import die_with_parent; die_with_parent(); open({str(path)!r}, 'w').write('k')"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), check=True, timeout=60)
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_role_that_ignores_sigterm_still_ends_when_its_launcher_dies(tmp_path):
    ready = tmp_path / "ready"
    role = textwrap.dedent(f"""
        import signal, time
        from core import proc
        proc.ORPHAN_GRACE_S = 0.5
        proc.die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a wait that never looks at its stop flag
        open({str(ready)!r}, "w").write("1")
        time.sleep(120)
    """)
    launcher = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, DRIFTRL_LAUNCHER_PID=str(os.getpid()))
        child = subprocess.Popen([sys.executable, "-c", {role!r}], env=env)
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        p.kill()
        p.wait()
        deadline = time.time() + 15
        while alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the role outlived its launcher"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
        if p.poll() is None:
            p.kill()


def test_memory_is_reported_and_its_peak_follows_what_the_process_touched():
    from core.proc import memory_mb

    before = memory_mb()
    assert before["rss_mb"] > 0 and before["peak_rss_mb"] >= before["rss_mb"] and before["shm_mb"] >= 0
    block = bytearray(64 << 20)  # zero-filled: every page touched
    after = memory_mb()
    assert after["peak_rss_mb"] >= before["rss_mb"] + 60 and after["rss_mb"] >= before["rss_mb"] + 60
    del block
