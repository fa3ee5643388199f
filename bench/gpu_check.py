"""One-GPU check of weightsync's device paths; writes a log and exits 0 only if every step ran.

    python -m bench.gpu_check LOG_PATH [--device cuda:N] [--steps default|all|a,b,...] [--ipc-mb MB]

Each step logs one line, ``OK`` or ``FAIL``; a step that cannot run as asked (no CUDA, no cupy,
one GPU where it needs two) is a failure, never a skip or a fallback, so ``GPU_CHECK PASS`` means
every requested step really ran:

1. ``env``       torch / CUDA / cupy / NCCL versions and the device name
2. ``layout``    header of a mixed-dtype dict (float32, bfloat16, float16, int64, int32) laid out
                 in several 1 MiB buckets; msgpack round trip of the header
3. ``buckets``   each bucket packed into a flat device buffer, moved into a second device buffer
                 by a single-rank ``NcclCommunicator.broadcast`` (cupy), unpacked into same-dtype
                 targets (bit-exact) and float32 targets
4. ``nccl-pub``  ``NcclPublisher`` with world_size 1 (backend nccl) publishes two versions
                 through its bucket buffers, side stream and broadcasts
5. ``cuda-ipc``  ``CudaIpcPublisher`` publishes versions of the mixed dict plus ``--ipc-mb`` MiB
                 of bfloat16 tensors; another process on the same device applies each with
                 ``CudaIpcSubscriber`` (bit-exact); publish+apply time against one plain
                 device-to-device copy of the same bytes: ``ratio`` = copy / (publish + apply),
                 ``apply_ratio`` = copy / apply (a publish is one copy into a slot, an apply one
                 copy out of it: ``ratio`` is at most about 0.5 by construction)
6. ``shm``       publish from device tensors into a /dev/shm version file, apply into device
                 tensors (bit-exact) and into float32 device tensors (dtype conversion)
7. ``fs``        the same through ``run_dir/weights`` (weightsync/files.py, transport filesystem)
8. ``nccl-2gpu`` (``--steps all`` or named) NcclPublisher on ``cuda:0``, a subscriber process on
                 ``cuda:1``, one version, bit-exact: FAIL on a machine with fewer than 2 GPUs

Expected output on a CUDA machine with cupy (figures vary)::

    OK env torch=2.x cuda=12.x cupy=13.x nccl=2xxxx device=NVIDIA H100 ...
    OK layout tensors=10 buckets=7 bytes=...
    OK buckets via=nccl-broadcast exact=10/10 widened=10/10
    OK nccl-pub backend=nccl versions=[0, 1] publish_ms=...
    OK cuda-ipc exact=4/4 bytes=... publish_ms=... apply_ms=... copy_ms=... ratio=0.4x apply_ratio=0.9x
    OK shm exact=10/10 widened=10/10 apply_ms=...
    OK fs exact=10/10
    GPU_CHECK PASS (7 steps)

Without cupy, steps 3 and 4 fail with ``cupy not installed``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # python bench/gpu_check.py

from core.files import read_json  # noqa: E402
from core.messages import WeightUpdateHeader, decoder, encode  # noqa: E402
from weightsync import layout  # noqa: E402


def _tensors(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, (dtype, shape) in enumerate([
        (torch.float32, (512, 384)), (torch.bfloat16, (1024, 256)), (torch.float16, (300, 7)),
        (torch.int64, (33,)), (torch.int32, (4, 4)), (torch.float32, (384,)), (torch.bfloat16, (700, 600)),
        (torch.float32, ()), (torch.bfloat16, (0, 5)), (torch.float32, (256, 1024)),
    ]):
        t = torch.randn(shape, generator=g) * 100
        out[f"t{i}"] = (t.to(dtype) if dtype.is_floating_point else t.to(torch.int64).to(dtype)).to(device)
    return out


def _exact(targets, named) -> int:
    return sum(torch.equal(targets[n], named[n]) for n in named)


def _widened(targets, named) -> int:
    return sum(torch.equal(targets[n], named[n].float()) for n in named)


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl  # noqa: F401

        return True
    except Exception:
        return False


def step_env(device, ctx):
    parts = [f"torch={torch.__version__}", f"cuda={torch.version.cuda}"]
    if _has_cupy():
        import cupy
        from cupy.cuda import nccl

        parts += [f"cupy={cupy.__version__}", f"nccl={nccl.get_version()}"]
    else:
        parts.append("cupy=absent")
    if device.type == "cuda":
        parts.append(f"device={torch.cuda.get_device_name(device)}")
    return "OK", " ".join(parts)


def step_layout(device, ctx):
    named = ctx["named"]
    h = layout.header_for(0, named, bucket_bytes=1 << 20)
    back = decoder(WeightUpdateHeader).decode(encode(h))
    ctx["header"] = h
    ok = back == h and len(h.buckets) > len({b.dtype for b in h.buckets})
    return ("OK" if ok else "FAIL"), f"tensors={len(h.names)} buckets={len(h.buckets)} bytes={layout.total_nbytes(h)}"


def step_buckets(device, ctx):
    named, h = ctx["named"], ctx["header"]
    if not _has_cupy():
        return "FAIL", "(cupy not installed)"
    import cupy
    from cupy.cuda import nccl

    from weightsync.nccl import _NcclComm

    uid = _NcclComm.new_id()
    major = int(cupy.__version__.split(".")[0])
    with cupy.cuda.Device(device.index):
        comm = nccl.NcclCommunicator(1, uid if major >= 14 else tuple(b - 256 if b > 127 else b for b in uid), 0)
    same = {n: torch.empty_like(t) for n, t in named.items()}
    wide = {n: torch.empty(t.shape, dtype=torch.float32, device=device) for n, t in named.items()}
    for i, b in enumerate(h.buckets):
        src = torch.zeros(b.nbytes, dtype=torch.uint8, device=device)
        for n, view in layout.views(h, src, bucket=i).items():
            view.copy_(named[n])
        dst = torch.empty_like(src)
        stream = torch.cuda.current_stream(device).cuda_stream
        comm.broadcast(src.data_ptr(), dst.data_ptr(), b.nbytes, nccl.NCCL_UINT8, 0, stream)
        for n, view in layout.views(h, dst, bucket=i).items():
            same[n].copy_(view)
            wide[n].copy_(view)
    torch.cuda.synchronize(device)
    comm.destroy()
    ex, wd = _exact(same, named), _widened(wide, named)
    ok = ex == wd == len(named)
    return ("OK" if ok else "FAIL"), f"via=nccl-broadcast exact={ex}/{len(named)} widened={wd}/{len(named)}"


def step_nccl_publisher(device, ctx):
    from weightsync.nccl import NcclPublisher

    if not _has_cupy():
        return "FAIL", "(cupy not installed)"
    named = ctx["named"]
    with tempfile.TemporaryDirectory() as run_dir:
        pub = NcclPublisher(run_dir, named, 1 << 20, world_size=1, backend="nccl", join_timeout_s=30)
        times = [pub.publish(v, named).seconds for v in (0, 1)]
        pub.close()
    return "OK", f"backend=nccl versions=[0, 1] publish_ms={times[-1] * 1e3:.2f}"


def step_shm(device, ctx):
    from weightsync.files import ShmPublisher, ShmSubscriber

    named = ctx["named"]
    with tempfile.TemporaryDirectory() as run_dir:
        pub = ShmPublisher(run_dir, named)
        sub = ShmSubscriber(run_dir, timeout_s=5)
        sub_wide = ShmSubscriber(run_dir, timeout_s=5)
        pub.publish(0, named)
        same = {n: torch.empty_like(t) for n, t in named.items()}
        wide = {n: torch.empty(t.shape, dtype=torch.float32, device=device) for n, t in named.items()}
        ok = sub.apply(same) == 0 and sub_wide.apply(wide) == 0
        for s in (sub, sub_wide, pub):
            s.close()
    ex, wd = _exact(same, named), _widened(wide, named)
    ok = ok and ex == wd == len(named)
    return ("OK" if ok else "FAIL"), f"exact={ex}/{len(named)} widened={wd}/{len(named)} apply_ms={sub.stats.apply_s * 1e3:.2f}"


def step_fs(device, ctx):
    from weightsync.files import FsPublisher, FsSubscriber

    named = ctx["named"]
    with tempfile.TemporaryDirectory() as run_dir:
        pub = FsPublisher(run_dir, named)
        pub.publish(3, named)
        sub = FsSubscriber(run_dir, timeout_s=5)
        same = {n: torch.empty_like(t) for n, t in named.items()}
        ok = sub.apply(same) == 3
        sub.close()
        pub.close()
    ex = _exact(same, named)
    return ("OK" if ok and ex == len(named) else "FAIL"), f"exact={ex}/{len(named)}"


# ---- cuda-ipc: publisher here, subscriber in another process on the same device -----------------

IPC_VERSIONS = 4
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/.. : the checkout


def _ipc_state(device, version: int, mb: int) -> dict[str, torch.Tensor]:
    """The mixed dict (fixed) plus ``mb`` MiB of bfloat16 in 16 MiB tensors filled per version."""
    out = {f"mixed.{n}": t for n, t in _tensors(device).items()}
    for i in range(max(1, mb // 16)):
        out[f"big.{i}"] = torch.full((8 << 20,), float((version * 31 + i) % 251), dtype=torch.bfloat16, device=device)
    return out


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _ipc_reader(run_dir: str, device: str, n_versions: str, mb: str, out_path: str) -> None:
    """The other process: apply every version it sees, check it, report progress as JSON."""
    from weightsync.cuda_ipc import CudaIpcSubscriber

    dev = torch.device(device)
    torch.cuda.set_device(dev)
    sub = CudaIpcSubscriber(run_dir, 60, device=dev)
    targets = {n: torch.empty_like(t) for n, t in _ipc_state(dev, 0, int(mb)).items()}
    done = {"applied": [], "exact": 0, "apply_s": []}
    deadline = time.monotonic() + 120
    while len(done["applied"]) < int(n_versions) and time.monotonic() < deadline:
        if sub.latest_version() <= sub.stats.last_version:
            time.sleep(1e-4)
            continue
        v = sub.apply(targets)
        want = _ipc_state(dev, v, int(mb))
        done["exact"] += all(torch.equal(targets[n], want[n]) for n in want)
        done["applied"].append(v)
        done["apply_s"].append(sub.stats.apply_s)
        _write_json(out_path, done)
    sub.close()


def _spawn(fn: str, *args) -> subprocess.Popen:
    """``bench.gpu_check.<fn>(*args)`` in a fresh interpreter (no pickle, no fork of CUDA)."""
    code = f"import sys; from bench.gpu_check import {fn}; {fn}(*sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=_REPO)


def _wait_for(path: str, key: str, n: int, proc: subprocess.Popen, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        got = (read_json(path) or {})
        if len(got.get(key, [])) >= n:
            return got
        time.sleep(1e-3)
    return (read_json(path) or {})


def _copy_s(nbytes: int, device) -> float:
    """Best of 5 plain device-to-device copies of ``nbytes`` (the bandwidth reference)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda device: None)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def step_cuda_ipc(device, ctx):
    from weightsync.cuda_ipc import CudaIpcPublisher

    mb = ctx.get("ipc_mb", 256)
    with tempfile.TemporaryDirectory() as run_dir:
        out = os.path.join(run_dir, "reader.json")
        pub = CudaIpcPublisher(run_dir, _ipc_state(device, 0, mb), max_readers=1)
        proc = _spawn("_ipc_reader", run_dir, device, IPC_VERSIONS, mb, out)
        try:
            publish_s = []
            for v in range(IPC_VERSIONS):
                publish_s.append(pub.publish(v, _ipc_state(device, v, mb)).seconds)
                got = _wait_for(out, "applied", v + 1, proc)  # one copy at a time: clean timings
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
            pub.close()
    return _ipc_verdict(got, publish_s, layout.payload_nbytes(pub.header), device, proc.returncode)


def _ipc_verdict(got: dict, publish_s: list[float], nbytes: int, device, rc) -> tuple[str, str]:
    if got.get("applied") != list(range(IPC_VERSIONS)):
        return "FAIL", f"reader applied {got.get('applied')} of {IPC_VERSIONS} versions (exit {rc})"
    pub, app = statistics.median(publish_s[1:]), statistics.median(got["apply_s"][1:])  # v0: opening
    copy = _copy_s(nbytes, device)
    ok = got["exact"] == IPC_VERSIONS and rc == 0
    return ("OK" if ok else "FAIL"), (
        f"exact={got['exact']}/{IPC_VERSIONS} bytes={nbytes} publish_ms={pub * 1e3:.3f} apply_ms={app * 1e3:.3f} "
        f"copy_ms={copy * 1e3:.3f} copy_GBps={nbytes / copy / 1e9:.0f} ratio={copy / (pub + app):.3f} "
        f"apply_ratio={copy / app:.3f}")


# ---- nccl-2gpu: rank 0 here on cuda:0, rank 1 in another process on cuda:1 ------------------------


def _nccl_reader(run_dir: str, device: str, out_path: str) -> None:
    from weightsync.nccl import NcclSubscriber

    dev = torch.device(device)
    torch.cuda.set_device(dev)
    sub = NcclSubscriber(run_dir, 60, device=dev, collective_timeout_s=60)
    targets = {n: torch.empty_like(t) for n, t in _tensors(dev).items()}
    deadline = time.monotonic() + 60
    while sub.latest_version() < 0 and time.monotonic() < deadline:
        time.sleep(1e-3)
    v = sub.apply(targets)
    _write_json(out_path, {"applied": [v], "exact": _exact(targets, _tensors(dev)), "rank": sub.rank})
    sub.close()


def step_nccl_two_gpus(device, ctx):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return "FAIL", f"(needs 2 GPUs, this machine has {n})"
    if not _has_cupy():
        return "FAIL", "(cupy not installed)"
    from weightsync.nccl import NcclPublisher

    with tempfile.TemporaryDirectory() as run_dir:
        out = os.path.join(run_dir, "reader.json")
        proc = _spawn("_nccl_reader", run_dir, "cuda:1", out)
        try:
            named = _tensors(torch.device("cuda:0"))
            with NcclPublisher(run_dir, named, 1 << 20, world_size=2, join_timeout_s=60) as pub:
                seconds = pub.publish(0, named).seconds
                got = _wait_for(out, "applied", 1, proc)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    ok = got.get("applied") == [0] and got.get("exact") == len(named) and proc.returncode == 0
    return ("OK" if ok else "FAIL"), f"ranks=2 exact={got.get('exact')}/{len(named)} publish_ms={seconds * 1e3:.2f}"


STEPS = {"env": step_env, "layout": step_layout, "buckets": step_buckets, "nccl-pub": step_nccl_publisher,
         "cuda-ipc": step_cuda_ipc, "shm": step_shm, "fs": step_fs, "nccl-2gpu": step_nccl_two_gpus}
DEFAULT_STEPS = ["env", "layout", "buckets", "nccl-pub", "cuda-ipc", "shm", "fs"]  # one GPU's


def cuda_problem(device: str) -> str | None:
    """Why ``device`` cannot run the check (not CUDA, no CUDA here), or None."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA device, got {device!r} (available: {torch.cuda.is_available()})"
    return None


def run_steps(log, dev: torch.device, steps: list[str], ctx: dict) -> list[str]:
    """Run ``steps`` in order, one OK/FAIL line each; the names of those that failed."""
    failed = []
    for name in steps:
        t0 = time.perf_counter()
        try:
            status, detail = STEPS[name](dev, ctx)
        except Exception:
            status, detail = "FAIL", traceback.format_exc().strip().replace("\n", "\n    ")
        _emit(log, f"{status} {name} {detail} ({time.perf_counter() - t0:.2f}s)")
        if status != "OK":
            failed.append(name)
            if name == "layout":
                break  # later steps need its header
    return failed


def _emit(log, line: str) -> None:
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


def run(log_path: str, device: str, steps: list[str] | None = None, ipc_mb: int = 256) -> bool:
    steps = steps or DEFAULT_STEPS
    with open(log_path, "w") as log:
        problem = cuda_problem(device)
        if problem:
            _emit(log, f"GPU_CHECK FAIL: {problem}; steps not run: {steps}")
            return False
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            torch.cuda.set_device(dev)
        if "layout" not in steps and any(s in steps for s in ("buckets", "shm", "fs")):
            steps = ["layout", *steps]  # their header
        failed = run_steps(log, dev, steps, {"named": _tensors(dev), "ipc_mb": ipc_mb})
        _emit(log, f"GPU_CHECK FAIL: {failed}" if failed else f"GPU_CHECK PASS ({len(steps)} steps)")
    return not failed


def _steps(text: str) -> list[str]:
    names = {"default": DEFAULT_STEPS, "all": list(STEPS)}.get(text) or text.split(",")
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown steps {unknown}; known: {', '.join(STEPS)}, default, all")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log_path")
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N")
    ap.add_argument("--steps", type=_steps, default=DEFAULT_STEPS,
                    help=f"default ({','.join(DEFAULT_STEPS)}), all (adds nccl-2gpu), or a comma list")
    ap.add_argument("--ipc-mb", type=int, default=256, help="MiB the cuda-ipc step moves per version")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    return 0 if run(args.log_path, args.device, args.steps, args.ipc_mb) else 1


if __name__ == "__main__":
    sys.exit(main())
