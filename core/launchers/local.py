"""Local launcher: every role a child process of this one, on this host. Children run in their own sessions, so a
terminal Ctrl-C reaches only the launcher, which then stops the roles in order by process id; a child ends with the
launcher even when it is SIGKILLed (core/proc.py: die_with_parent)."""

from __future__ import annotations

import contextlib
import os
import subprocess

from core.launchers import ROOT, Launcher, Role


# glibc otherwise mmaps and unmaps every ~1 MB activation: 700-2000 page faults per learner
# step; keeping freed memory in the heap made learner steps ~5% and generation ~17% faster
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000",
                 "MALLOC_TOP_PAD_": str(256 << 20)}


def start_process(argv: list[str], log_path: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """``argv`` in its own session, output appended to ``log_path``; its environment is this one's (+ ``extra_env``)
    with the checkout on the path and this process as its launcher (core/proc.py: the role ends when it does),
    one thread and the allocator settings unless told."""
    env = {"OMP_NUM_THREADS": "1", **ALLOCATOR_ENV, **os.environ, "DRIFTRL_LAUNCHER_PID": str(os.getpid()),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    with open(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as logf:
        return subprocess.Popen(argv, cwd=ROOT, env={**env, **(extra_env or {})}, stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


class LocalLauncher(Launcher):
    name = "local"

    def spawn(self, role: Role, run_dir: str) -> None:
        role.handle = start_process(role.argv, role.log_path)

    def returncode(self, role: Role) -> int | None:
        return role.handle.poll()

    def signal(self, role: Role, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone: nothing to stop
            role.handle.send_signal(sig)
