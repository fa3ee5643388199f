"""One learner step, measured: its wall time, the FLOP/s it achieves against this machine's own
matmul throughput, and its peak resident memory against the state it must hold, in one run.

The batch is real: ``learner.groups_per_step`` prompts x ``actor.group_size`` samples from the
configured engine (``bench.common.engine_batch``), collated as the learner receives them. The
backend is the configured one (``learner.backend``, ``learner.body_dtype`` under ``auto``,
``learner.threads`` torch threads). Timed: ``--steps`` optimiser steps after one warm-up step.

* ``flops_frac_of_matmul``: the matmul FLOPs one step executes (counted by the torch profiler:
  ``mm``, ``addmm``, ``bmm``, forward, backward and the FP32 head's recompute under activation
  checkpointing, divided by the median step's wall time) over a plain ``torch.mm`` of the body's
  widest shape (tokens x hidden @ hidden x intermediate) in the body's dtype, same threads, same
  process (target >= 0.4: the step's time goes to its matmuls, not to what surrounds them).
  ``flops_frac_of_fp32_matmul``: the same over an FP32 matmul of that shape (the same figure when the
  body is FP32; with a BF16 body on a CPU with AMX it is the looser one, as BF16 matmuls run ~10x faster).
* ``peak_over_state``: the learner's peak resident memory (VmHWM) over its weights + gradients +
  AdamW's two moments, all FP32 (target <= 1.5). Measured as a learner runs: in a child process with
  the launcher's allocator settings, on groups another child made with the engine and handed over as
  msgpack (a learner never hosts an engine, whose weights, cache and free lists are not its own).
  ``live_peak_over_state``: the most the learner's allocations held at once (glibc's ``mallinfo2``,
  polled every 5 ms during the steps) over the same state: what the learner needs. The difference
  from ``peak_over_state`` is the heap glibc kept touched around it (fragmentation: the launcher's
  settings map nothing and return nothing, so a freed block is reused only by what fits in it).

The last stdout line is one JSON object: {"bench": "learner", "step_s": ..., "flops_frac_of_matmul":
..., "peak_over_state": ..., ...}.

    python bench/learner.py [--config configs/smollm2.toml] [-o section.key=value ...] [--steps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402
import torch  # noqa: E402

from bench.common import engine_groups, format_table, load_avg  # noqa: E402
from core import config as C  # noqa: E402
from core import messages as M  # noqa: E402
from core.launchers.local import ALLOCATOR_ENV  # noqa: E402
from core.proc import learner_state_mb, memory_mb  # noqa: E402
from core import precision  # noqa: E402
from model.attention import DTYPES  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")  # the kernels: a linear or matmul reaches one of these


def reset_peak() -> None:
    """VmHWM back to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def live_heap_peak(stop: threading.Event, out: list) -> None:
    """Poll glibc's bytes in use (heap and mmapped) until ``stop``; the most, in MB, goes to ``out[0]``
    (None without glibc >= 2.33)."""
    try:
        info = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return
    info.restype = _MallInfo2
    while not stop.wait(0.005):
        m = info()
        out[0] = max(out[0] or 0.0, (m.uordblks + m.hblkhd) / 2**20)


def step_flops(backend, batch) -> float:
    """Matmul FLOPs of one optimiser step, as the torch profiler counts them (the kernels only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        backend.step(batch)
    return float(sum(e.flops for e in prof.events() if e.name in MATMUL_OPS and e.flops))


def matmul_flops_per_s(tokens: int, hidden: int, inner: int, dtype: torch.dtype, seconds: float = 2.0) -> float:
    """Sustained FLOP/s of ``[tokens, hidden] @ [hidden, inner]`` in ``dtype``: the body's widest matmul."""
    a, b = torch.randn(tokens, hidden).to(dtype), torch.randn(hidden, inner).to(dtype)
    a @ b  # warm-up: the kernel's one-off packing and allocation
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return n * 2 * tokens * hidden * inner / (time.perf_counter() - t0)


def in_children(args) -> dict:
    """:func:`measure` in a child process started as the launcher starts a learner (its allocator settings), on
    the groups another child made with the engine (:func:`bench.common.engine_groups`), handed over as msgpack."""
    given = (["--config", args.config] if args.config else []) + [f"-o{o}" for o in args.override]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "groups.msgpack")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--groups-to", path, *given], check=True)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", path, "--steps", str(args.steps),
                              *given], check=True, stdout=subprocess.PIPE, text=True, env={**ALLOCATOR_ENV, **os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(cfg: C.Config, steps: int, groups: list[M.RolloutGroup]) -> dict:
    from learner.backends import make_backend
    from learner.batching import collate

    torch.manual_seed(0)
    batch = collate(groups, learner_version=0)
    del groups
    gc.collect()
    torch.set_num_threads(cfg.learner.threads)
    reset_peak()
    base_mb = memory_mb()["rss_mb"]
    backend = make_backend(cfg, cfg.model.path)
    times, live, stop = [], [None], threading.Event()
    poller = threading.Thread(target=live_heap_peak, args=(stop, live), daemon=True)
    poller.start()
    for _ in range(steps + 1):  # the first step pays one-off allocations (AdamW's moments among them)
        t0 = time.perf_counter()
        backend.step(batch)
        times.append(time.perf_counter() - t0)
    stop.set()
    poller.join()
    peak_mb = memory_mb()["peak_rss_mb"]
    flops = step_flops(backend, batch)
    params = sum(p.numel() for p in backend.model.parameters())
    body = backend.model.cfg
    dtype = DTYPES[precision.dtype_name(cfg.learner.body_dtype, "cpu")]
    tokens = int(batch.ids.numel())
    peak_mm = matmul_flops_per_s(tokens, body.hidden_size, body.intermediate_size, dtype)
    fp32_mm = peak_mm if dtype == torch.float32 else matmul_flops_per_s(
        tokens, body.hidden_size, body.intermediate_size, torch.float32)
    step_s = statistics.median(times[1:])
    state_mb = learner_state_mb(params)
    return {"step_s": step_s, "steps": steps, "tokens": tokens, "params": params, "body_dtype": str(dtype),
            "step_flops": flops, "flops_per_s": flops / step_s, "matmul_flops_per_s": peak_mm,
            "flops_frac_of_matmul": flops / step_s / peak_mm, "fp32_matmul_flops_per_s": fp32_mm,
            "flops_frac_of_fp32_matmul": flops / step_s / fp32_mm, "peak_rss_mb": peak_mb, "base_rss_mb": base_mb,
            "state_mb": state_mb, "peak_over_state": peak_mb / state_mb,
            "peak_above_base_over_state": (peak_mb - base_mb) / state_mb, "live_peak_mb": live[0],
            "live_peak_over_state": live[0] and live[0] / state_mb, "threads": cfg.learner.threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a driftrl config (default: the default job's)")
    ap.add_argument("-o", "--override", action="append", default=[], help="section.key=value")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups-to", help=argparse.SUPPRESS)  # the children's parts (in_children)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from jobs import resolve_model

    load = load_avg()[0]
    cfg = resolve_model(C.load(args.config, args.override))
    if args.groups_to:
        with open(args.groups_to, "wb") as f:
            f.write(M.encode(engine_groups(cfg)))
        return
    if args.measure:
        with open(args.measure, "rb") as f:
            print(json.dumps(measure(cfg, args.steps, msgspec.msgpack.decode(f.read(), type=list[M.RolloutGroup]))))
        return
    r = in_children(args)
    print(f"learner step on {cfg.model.path}: {r['params'] / 1e6:.1f}M params, body {r['body_dtype']}, "
          f"{r['tokens']} padded tokens, {r['threads']} thread(s); load average {load:.2f} -> {load_avg()[0]:.2f}")
    print(format_table(["step s", "GFLOP/step", "GFLOP/s", "matmul GFLOP/s", "of matmul", "of FP32 mm", "peak MB",
                        "base MB", "state MB", "peak/state", "live/state"],
                       [[round(r["step_s"], 3), round(r["step_flops"] / 1e9, 1), round(r["flops_per_s"] / 1e9, 1),
                         round(r["matmul_flops_per_s"] / 1e9, 1), round(r["flops_frac_of_matmul"], 3),
                         round(r["flops_frac_of_fp32_matmul"], 3),
                         round(r["peak_rss_mb"]), round(r["base_rss_mb"]), round(r["state_mb"]),
                         round(r["peak_over_state"], 2),
                         r["live_peak_over_state"] and round(r["live_peak_over_state"], 2)]]))
    print(json.dumps({"bench": "learner", "config": args.config, "overrides": args.override, **r,
                      "load_before": round(load, 2)}))


if __name__ == "__main__":
    main()
