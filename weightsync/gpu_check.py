"""One-GPU check of weightsync's device paths; writes a log and exits 0 on success.

    python -m weightsync.gpu_check LOG_PATH [--device cuda:N]

Each step logs one line, ``OK`` or ``FAIL``; a step that cannot run as asked (no CUDA, no cupy)
is a failure, never a skip, so ``GPU_CHECK PASS`` means every step below really ran:

1. ``env``      torch / CUDA / cupy / NCCL versions and the device name
2. ``layout``   header of a mixed-dtype dict (float32, bfloat16, float16, int64, int32) laid out
                in several 1 MiB buckets; msgpack round trip of the header
3. ``buckets``  each bucket packed into a flat device buffer, moved into a second device buffer
                by a single-rank ``NcclCommunicator.broadcast`` (cupy; else a torch copy, logged
                as such), unpacked into same-dtype targets (bit-exact) and float32 targets
4. ``nccl-pub`` ``NcclPublisher`` with world_size 1 publishes two versions through its bucket
                buffers, side stream and broadcasts (backend nccl on CUDA+cupy, else gloo)
5. ``shm``      shared-memory publish from device tensors, apply into device tensors
                (bit-exact) and into float32 device tensors (dtype conversion)
6. ``fs``       filesystem publish from device tensors, apply into device tensors

Expected output on a CUDA machine with cupy (figures vary)::

    OK env torch=2.x cuda=12.x cupy=13.x nccl=2xxxx device=NVIDIA H100 ...
    OK layout tensors=10 buckets=7 bytes=...
    OK buckets via=nccl-broadcast exact=10/10 widened=10/10
    OK nccl-pub backend=nccl versions=[0, 1] publish_ms=...
    OK shm exact=10/10 widened=10/10 apply_ms=...
    OK fs exact=10/10
    GPU_CHECK PASS (6 steps)

Without cupy, steps 3 and 4 fail with ``cupy not installed``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback

import torch

from core.messages import WeightUpdateHeader, decoder, encode
from weightsync import layout


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
    from weightsync.shm import ShmPublisher, ShmSubscriber

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
    from weightsync.filesystem import FsPublisher, FsSubscriber

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


STEPS = [("env", step_env), ("layout", step_layout), ("buckets", step_buckets),
         ("nccl-pub", step_nccl_publisher), ("shm", step_shm), ("fs", step_fs)]


def run(log_path: str, device: str) -> bool:
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        with open(log_path, "w") as log:
            log.write(f"GPU_CHECK FAIL: needs a CUDA device, got {device!r} (available: {torch.cuda.is_available()})\n")
        return False
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    torch.cuda.set_device(dev)
    ctx = {"named": _tensors(dev)}
    failed = []
    with open(log_path, "w") as log:
        for name, fn in STEPS:
            t0 = time.perf_counter()
            try:
                status, detail = fn(dev, ctx)
            except Exception:
                status, detail = "FAIL", traceback.format_exc().strip().replace("\n", "\n    ")
            line = f"{status} {name} {detail} ({time.perf_counter() - t0:.2f}s)"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
            if status == "FAIL":
                failed.append(name)
                if name in ("layout",):
                    break  # later steps need its header
        final = f"GPU_CHECK FAIL: {failed}" if failed else f"GPU_CHECK PASS ({len(STEPS)} steps)"
        print(final)
        log.write(final + "\n")
    return not failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log_path")
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    return 0 if run(args.log_path, args.device) else 1


if __name__ == "__main__":
    sys.exit(main())
