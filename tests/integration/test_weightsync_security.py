"""Weight sync among strangers on one host, and waits that honour stop.

/dev/shm is shared by every user: a region's name must be unpredictable, created exclusively,
private (0600, this uid), and refused by a subscriber otherwise. A SIGKILLed publisher's region
is removed by the next one. Every wait for a publisher (or for subscribers) ends on ``stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import zmq

from weightsync import shm
from weightsync.base import Stopped, make_subscriber

NOBODY = 65534


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}


def _regions() -> set[str]:
    return {n for n in os.listdir(shm._shm_dir()) if n.startswith("driftrl-weights-")}


@pytest.fixture
def run_dir(tmp_path):
    d = str(tmp_path / "run")
    yield d
    with contextlib.suppress(OSError):
        path = shm.region_path(d)
        for p in (path, f"{path}.tmp") if path else ():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


# ---- names, records, modes ------------------------------------------------------------------


def test_region_name_is_random_recorded_and_private(run_dir):
    pub = shm.ShmPublisher(run_dir, _model())
    first = pub.path
    record = os.path.join(run_dir, shm.RECORD)
    assert shm.region_path(run_dir) == first
    for p in (first, record):
        st = os.stat(p)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600, (p, oct(st.st_mode))
    pub.close()
    pub2 = shm.ShmPublisher(run_dir, _model())  # same run_dir, a fresh name: nothing to predict
    assert pub2.path != first and os.path.dirname(pub2.path) == os.path.dirname(first)
    assert len(os.path.basename(pub2.path)) - len("driftrl-weights-") == 32
    pub2.close()


@pytest.mark.parametrize("which", ["region", "record"])
def test_subscriber_refuses_a_region_others_may_write(run_dir, which):
    pub = shm.ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    target = pub.path if which == "region" else os.path.join(run_dir, shm.RECORD)
    os.chmod(target, 0o644)
    with pytest.raises(shm.UnsafeRegion, match="mode 0644"):
        shm.ShmSubscriber(run_dir, timeout_s=5)
    os.chmod(target, 0o600)  # back to private: accepted
    sub = shm.ShmSubscriber(run_dir, timeout_s=5)
    assert sub.latest_version() == 0
    sub.close()
    pub.close()


def test_subscriber_refuses_a_recorded_name_that_is_not_a_region(run_dir, tmp_path):
    os.makedirs(run_dir)
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"keep me")
    os.chmod(victim, 0o600)
    from core.files import atomic_write

    atomic_write(os.path.join(run_dir, shm.RECORD), f"{victim}\n".encode(), mode=0o600)
    with pytest.raises(shm.UnsafeRegion, match="not a driftrl weight region name"):
        shm.ShmSubscriber(run_dir, timeout_s=5)
    assert victim.read_bytes() == b"keep me"  # never opened for writing


def _root_only():
    if os.geteuid() != 0:
        pytest.skip("needs root to own files as, or become, another uid")


def test_subscriber_refuses_a_region_another_uid_owns(run_dir):
    _root_only()
    pub = shm.ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    os.chown(pub.path, NOBODY, -1)
    with pytest.raises(shm.UnsafeRegion, match=f"owned by uid {NOBODY}"):
        shm.ShmSubscriber(run_dir, timeout_s=5)
    os.chown(pub.path, 0, -1)
    pub.close()


def _as_nobody(fn) -> dict:
    """Run ``fn()`` in a forked child that became uid 65534; its dict result (or a skip)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: syscalls and this module's pure-Python checks only, then _exit
        os.close(r)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as e:  # noqa: BLE001 -- anything is reported to the parent
            out = {"setup_error": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    if "setup_error" in out:
        pytest.skip(f"could not act as uid {NOBODY}: {out['setup_error']}")
    return out


def _try(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the outcome is the test's subject
        return type(e).__name__
    return "ok"


def test_a_second_user_cannot_open_or_precreate_the_runs_shared_memory(monkeypatch):
    _root_only()
    run_dir = tempfile.mkdtemp(prefix="driftrl-victim-")
    os.chmod(run_dir, 0o755)  # even a readable run_dir does not give the region away
    pub = shm.ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    record = os.path.join(run_dir, shm.RECORD)
    try:
        # the stranger learns the name anyway (ls /dev/shm) and tries everything
        got = _as_nobody(lambda: {
            "read_region": _try(lambda: os.close(os.open(pub.path, os.O_RDONLY))),
            "write_region": _try(lambda: os.close(os.open(pub.path, os.O_RDWR))),
            "read_record": _try(lambda: open(record, "rb").close()),
            "replace_record": _try(lambda: open(record + ".x", "wb").close()),
            "subscribe": _try(lambda: shm.ShmSubscriber(run_dir, timeout_s=0.5)),
        })
        assert got == {"read_region": "PermissionError", "write_region": "PermissionError",
                       "read_record": "PermissionError", "replace_record": "PermissionError",
                       "subscribe": "UnsafeRegion"}, got
        pub.close()

        # pre-creation: a stranger who guessed the next name holds it first, with forged bytes
        guess = shm._new_region_path()
        forged = b"DRFTWS02" + b"\0" * 4088
        assert _as_nobody(lambda: {"made": _try(lambda: _make(guess, forged))}) == {"made": "ok"}
        monkeypatch.setattr(shm, "_new_region_path", lambda: guess)
        with pytest.raises(shm.UnsafeRegion, match="someone else created this name"):
            shm.ShmPublisher(run_dir, _model())
        # the record now names the stranger's file: the victim's actor refuses it
        assert shm.region_path(run_dir) == guess
        with pytest.raises(shm.UnsafeRegion, match=f"owned by uid {NOBODY}"):
            shm.ShmSubscriber(run_dir, timeout_s=5)
        with open(guess, "rb") as f:
            assert f.read() == forged  # never written to by the victim
    finally:
        with contextlib.suppress(OSError, NameError):
            os.unlink(guess)
        subprocess.run(["rm", "-rf", run_dir], check=False)


def _make(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, data)
    os.close(fd)


# ---- dead publishers ---------------------------------------------------------------------------

_LEARNER = """
import sys, time, torch
from weightsync import shm
pub = shm.ShmPublisher(sys.argv[1], {"w": torch.ones(16, 8), "b": torch.ones(8)})
pub.publish(0, {"w": torch.ones(16, 8), "b": torch.ones(8)})
print(pub.path, flush=True)
time.sleep(600)
"""


def test_sigkilled_publisher_leaves_no_orphan_region_after_the_next_start(run_dir):
    before = _regions()
    learner = subprocess.Popen([sys.executable, "-c", _LEARNER, run_dir], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        old = learner.stdout.readline().strip()
        assert old and os.path.exists(old)
        sub = shm.ShmSubscriber(run_dir, timeout_s=30)
        learner.send_signal(signal.SIGKILL)
        learner.wait(30)
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
    assert os.path.exists(old)  # SIGKILL ran no finalizer: the region is still there
    pub = shm.ShmPublisher(run_dir, _model(1))  # the restarted learner
    assert not os.path.exists(old) and not os.path.exists(f"{old}.tmp")
    pub.publish(1, _model(1))
    sub._next_reattach = 0.0
    assert sub.latest_version() == 1  # its reader moved to the new region
    sub.close()
    pub.close()
    assert _regions() <= before  # nothing of this run is left in /dev/shm


def test_remove_dead_region_spares_a_live_publisher(run_dir):
    assert shm.remove_dead_region(run_dir) == 0  # nothing recorded yet
    pub = shm.ShmPublisher(run_dir, _model())
    assert shm.remove_dead_region(run_dir) == os.getpid() and os.path.exists(pub.path)
    pub.close()
    assert shm.remove_dead_region(run_dir) == 0  # recorded, but closed and gone


# ---- stop ---------------------------------------------------------------------------------------


def _stopped_within(make, stop_after_s: float = 0.2, deadline_s: float = 120):
    """``make(stop)`` must raise Stopped once the event is set, long before its own deadline."""
    ev = threading.Event()
    threading.Timer(stop_after_s, ev.set).start()
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        make(ev, deadline_s)
    assert time.monotonic() - t0 < deadline_s / 2


@pytest.mark.parametrize("transport", ["shm", "filesystem", "nccl"])
def test_waiting_for_the_publisher_honours_stop(tmp_path, transport):
    from core.config import load

    cfg = load(None, [f'weightsync.transport="{transport}"'])
    _stopped_within(lambda ev, t: make_subscriber(cfg, str(tmp_path), timeout_s=t, stop=ev))


def test_stop_may_be_a_callable(tmp_path):
    flag = []
    threading.Timer(0.2, flag.append, args=[1]).start()
    with pytest.raises(Stopped, match="stopped while waiting"):
        shm.ShmSubscriber(str(tmp_path), timeout_s=120, stop=lambda: bool(flag))


def test_nccl_joins_honour_stop(tmp_path):
    from weightsync.nccl import NcclPublisher, NcclSubscriber, endpoint_path

    # the publisher waiting for subscribers that never come
    _stopped_within(lambda ev, t: NcclPublisher(str(tmp_path / "p"), _model(), world_size=2, backend="gloo",
                                                join_timeout_s=t, stop=ev))
    # a subscriber whose publisher took its hello but never assigns a rank
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    path = endpoint_path(str(tmp_path / "s"))
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"host": "127.0.0.1", "port": port}, f)
    try:
        _stopped_within(lambda ev, t: NcclSubscriber(str(tmp_path / "s"), timeout_s=t, stop=ev))
        assert router.poll(5000)  # it did get as far as saying hello
    finally:
        router.close(linger=0)
        ctx.term()
