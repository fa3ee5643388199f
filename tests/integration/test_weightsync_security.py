"""Weight sync among strangers on one host, and waits that honour stop.

/dev/shm is shared by every user: the shm transport's directory must have an unpredictable name,
be created exclusively, be private (0700, this uid; its run_dir record 0600), and be refused by a
subscriber otherwise. A SIGKILLed publisher's directory is removed by the next one, and by
``remove_dead_region`` once the run is over. Every wait for a publisher (or for subscribers) ends
on ``stop``.
"""

from __future__ import annotations

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

from weightsync import files
from weightsync.base import Stopped, make_subscriber
from weightsync.files import ShmPublisher, ShmSubscriber, UnsafeDirectory

NOBODY = 65534


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}


def _ours() -> set[str]:
    return {n for n in os.listdir(files._shm_root("/")) if n.startswith("driftrl-weights-")}


@pytest.fixture
def run_dir(tmp_path):
    d = str(tmp_path / "run")
    yield d
    files.remove_dead_region(d)


# ---- names, records, modes ------------------------------------------------------------------


def test_directory_name_is_random_recorded_and_private(run_dir):
    pub = ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    first = pub.dir
    record = os.path.join(run_dir, files.RECORD)
    assert files.recorded_dir(run_dir) == first
    for p, mode in ((first, 0o700), (record, 0o600), (os.path.join(first, "v0"), 0o600)):
        st = os.stat(p)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == mode, (p, oct(st.st_mode))
    pub.close()
    pub2 = ShmPublisher(run_dir, _model())  # same run_dir, a fresh name: nothing to predict
    assert pub2.dir != first and os.path.dirname(pub2.dir) == os.path.dirname(first)
    assert len(os.path.basename(pub2.dir)) - len("driftrl-weights-") == 32
    pub2.close()


@pytest.mark.parametrize("which", ["directory", "record"])
def test_subscriber_refuses_a_directory_others_may_use(run_dir, which):
    pub = ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    target, mode = (pub.dir, 0o755) if which == "directory" else (os.path.join(run_dir, files.RECORD), 0o644)
    private = stat.S_IMODE(os.stat(target).st_mode)
    os.chmod(target, mode)
    with pytest.raises(UnsafeDirectory, match=f"mode {mode:04o}"):
        ShmSubscriber(run_dir, timeout_s=5)
    os.chmod(target, private)  # back to private: accepted
    sub = ShmSubscriber(run_dir, timeout_s=5)
    assert sub.latest_version() == 0
    sub.close()
    pub.close()


def test_filesystem_subscriber_refuses_a_directory_others_may_use(tmp_path):
    pub = files.FsPublisher(str(tmp_path), _model())
    assert stat.S_IMODE(os.stat(pub.dir).st_mode) == 0o700
    os.chmod(pub.dir, 0o777)
    with pytest.raises(UnsafeDirectory, match="mode 0777"):
        files.FsSubscriber(str(tmp_path), timeout_s=5)
    pub.close()


def test_subscriber_refuses_a_recorded_name_that_is_not_a_weights_directory(run_dir, tmp_path):
    os.makedirs(run_dir)
    victim = tmp_path / "precious"
    victim.mkdir(mode=0o700)
    from core.files import atomic_write

    atomic_write(os.path.join(run_dir, files.RECORD), f"{victim}\n".encode(), mode=0o600)
    with pytest.raises(UnsafeDirectory, match="not a driftrl weights directory name"):
        ShmSubscriber(run_dir, timeout_s=5)
    # a symlink where the directory should be is refused, never followed
    fake = os.path.join(files._shm_root(run_dir), f"driftrl-weights-{'ab' * 16}")
    os.symlink(str(victim), fake)
    try:
        atomic_write(os.path.join(run_dir, files.RECORD), f"{fake}\n".encode(), mode=0o600)
        with pytest.raises(UnsafeDirectory, match="not a directory"):
            ShmSubscriber(run_dir, timeout_s=5)
        assert files.remove_dead_region(run_dir) == 0 and os.path.islink(fake)  # not touched either
    finally:
        os.unlink(fake)


def _root_only():
    if os.geteuid() != 0:
        pytest.skip("needs root to own files as, or become, another uid")


def test_subscriber_refuses_a_directory_another_uid_owns(run_dir):
    _root_only()
    pub = ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    os.chown(pub.dir, NOBODY, -1)
    with pytest.raises(UnsafeDirectory, match=f"owned by uid {NOBODY}"):
        ShmSubscriber(run_dir, timeout_s=5)
    os.chown(pub.dir, 0, -1)
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


def test_a_second_user_cannot_read_plant_or_precreate_the_runs_weights(monkeypatch):
    _root_only()
    run_dir = tempfile.mkdtemp(prefix="driftrl-victim-")
    os.chmod(run_dir, 0o755)  # even a readable run_dir does not give the weights away
    pub = ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    record = os.path.join(run_dir, files.RECORD)
    version = os.path.join(pub.dir, "v0")
    guess = os.path.join(files._shm_root(run_dir), f"driftrl-weights-{'cd' * 16}")
    try:
        # the stranger learns the name anyway (ls /dev/shm) and tries everything
        got = _as_nobody(lambda: {
            "list_dir": _try(lambda: os.listdir(pub.dir)),
            "read_version": _try(lambda: os.close(os.open(version, os.O_RDONLY))),
            "plant_file": _try(lambda: os.close(os.open(os.path.join(pub.dir, "v9"), os.O_WRONLY | os.O_CREAT))),
            "read_record": _try(lambda: open(record, "rb").close()),
            "replace_record": _try(lambda: open(record + ".x", "wb").close()),
            "subscribe": _try(lambda: ShmSubscriber(run_dir, timeout_s=0.5)),
        })
        assert got == {"list_dir": "PermissionError", "read_version": "PermissionError",
                       "plant_file": "PermissionError", "read_record": "PermissionError",
                       "replace_record": "PermissionError", "subscribe": "UnsafeDirectory"}, got
        pub.close()

        # pre-creation: a stranger who guessed the next name holds it first
        assert _as_nobody(lambda: {"made": _try(lambda: os.mkdir(guess, 0o777))}) == {"made": "ok"}
        monkeypatch.setattr(files.secrets, "token_hex", lambda n: "cd" * n)
        with pytest.raises(UnsafeDirectory, match="someone else created this name"):
            ShmPublisher(run_dir, _model())
        # the record now names the stranger's directory: the victim's actor refuses it
        assert files.recorded_dir(run_dir) == guess
        with pytest.raises(UnsafeDirectory, match=f"owned by uid {NOBODY}"):
            ShmSubscriber(run_dir, timeout_s=5)
        assert files.remove_dead_region(run_dir) == 0 and os.path.isdir(guess)  # not the victim's to remove
    finally:
        if os.path.isdir(guess):
            os.rmdir(guess)
        subprocess.run(["rm", "-rf", run_dir], check=False)


# ---- dead publishers ---------------------------------------------------------------------------

_LEARNER = """
import sys, time, torch
from weightsync.files import ShmPublisher
pub = ShmPublisher(sys.argv[1], {"w": torch.ones(16, 8), "b": torch.ones(8)})
pub.publish(0, {"w": torch.ones(16, 8), "b": torch.ones(8)})
print(pub.dir, flush=True)
time.sleep(600)
"""


def _start_learner(run_dir: str) -> tuple[subprocess.Popen, str]:
    learner = subprocess.Popen([sys.executable, "-c", _LEARNER, run_dir], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return learner, learner.stdout.readline().strip()


def _kill(learner: subprocess.Popen) -> None:
    if learner.poll() is None:
        learner.send_signal(signal.SIGKILL)
    learner.wait(30)


def test_sigkilled_publisher_leaves_no_orphan_directory_after_the_next_start(run_dir):
    before = _ours()
    learner, old = _start_learner(run_dir)
    try:
        assert old and os.path.isdir(old)
        sub = ShmSubscriber(run_dir, timeout_s=30)
        got = {k: torch.zeros_like(v) for k, v in _model().items()}
        assert sub.apply(got) == 0  # mapped from the learner's file
        with pytest.raises(RuntimeError, match="already live"):
            ShmPublisher(run_dir, _model(1))  # the kernel still holds the learner's lock
    finally:
        _kill(learner)
    assert os.path.isdir(old)  # SIGKILL ran no finalizer: the directory is still there
    pub = ShmPublisher(run_dir, _model(1))  # the restarted learner
    assert not os.path.exists(old)
    assert torch.equal(got["w"], torch.ones(16, 8))  # the actor's mapped weights outlive the unlink
    pub.publish(1, _model(1))
    sub._next_find = 0.0
    assert sub.latest_version() == 1  # its reader moved to the new directory
    sub.close()
    pub.close()
    assert _ours() <= before  # nothing of this run is left in /dev/shm


def test_remove_dead_region_spares_a_live_publisher_and_clears_a_dead_one(run_dir):
    assert files.remove_dead_region(run_dir) == 0  # nothing recorded yet
    pub = ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    assert files.remove_dead_region(run_dir) == 0 and os.path.exists(os.path.join(pub.dir, "v0"))
    pub.close()
    assert files.remove_dead_region(run_dir) == 0  # closed: nothing left to remove
    learner, old = _start_learner(run_dir)
    _kill(learner)
    assert files.remove_dead_region(run_dir) == 2  # v0 and LATEST (jobs.train calls it after every run)
    assert not os.path.exists(old) and not os.path.exists(os.path.join(run_dir, files.RECORD))


# ---- stop ---------------------------------------------------------------------------------------


def _stopped_within(make, stop_after_s: float = 0.2, deadline_s: float = 120):
    """``make(stop)`` must raise Stopped once the event is set, long before its own deadline."""
    ev = threading.Event()
    threading.Timer(stop_after_s, ev.set).start()
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        make(ev, deadline_s)
    assert time.monotonic() - t0 < deadline_s / 2


@pytest.mark.parametrize("transport", ["shm", "filesystem", "nccl", "cuda_ipc"])
def test_waiting_for_the_publisher_honours_stop(tmp_path, transport):
    from core.config import load

    cfg = load(None, [f'weightsync.transport="{transport}"'])
    _stopped_within(lambda ev, t: make_subscriber(cfg, str(tmp_path), timeout_s=t, stop=ev, device="cpu"))


def test_stop_may_be_a_callable(tmp_path):
    flag = []
    threading.Timer(0.2, flag.append, args=[1]).start()
    with pytest.raises(Stopped, match="stopped while waiting"):
        ShmSubscriber(str(tmp_path), timeout_s=120, stop=lambda: bool(flag))


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
