"""Helpers of the tests that run whole jobs: the tiny run's overrides, the model cache they
share, reading a run directory, and telling whether a role process is still there."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_RUN = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
            "model.intermediate_size=64", "model.pretrain_steps=40", "learner.groups_per_step=4",
            "actor.group_size=4", "actor.groups_per_batch=2", "run.eval_every=0", "monitor.live=off",
            # this model scores 0 on every group: each actor (re)start would first leave 64 out
            # (actor/worker.py MAX_UNIFORM_IN_A_ROW); test_run.py runs the default with it on
            "actor.skip_uniform_groups=false"]


@functools.lru_cache(maxsize=None)
def models_dir() -> str:
    """The ``model.cache_dir`` of the whole-run tests: one per pytest process, so the tiny base model
    (cached under a hash of its recipe: the same in TINY_RUN's runs) is built by the first run that
    needs it and reused by the others instead of built again in every test. A private temporary
    directory removed at exit, like tests/support/tiny.py's: the tests never touch ``.cache``."""
    path = tempfile.mkdtemp(prefix="driftrl-models-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def lines(path) -> list[dict]:
    """The JSON lines of ``path`` (none if it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def read_json(path: str):
    """A JSON file a role rewrites in place (pids.json, ports.json): None while absent or half written."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wait_until(cond, timeout_s: float, every: float = 0.1) -> bool:
    """Poll ``cond()`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return False
