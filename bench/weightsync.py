"""Bench: a weight update through shared memory vs. a plain memory copy of the same bytes.

For two float32 decoder-shaped models (~10M and ~100M parameters) it times, in one process and
interleaved rep by rep so both see the same machine load:

* ``publish``  learner tensors -> the shm slot (``ShmPublisher.publish``)
* ``apply``    the shm slot -> the actor's tensors (``ShmSubscriber.apply``, seqlock included)
* ``memcpy``   ``dst.copy_(src)`` of one flat buffer holding the same number of bytes

An update is at least two copies (into shared memory, out of it), so ``(publish+apply)/memcpy``
is ~2 at best; the target is <= 2 for the worst size. Medians over ``--reps``.
Last line: one JSON object with the figures.

    python bench/weightsync.py [--reps 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync.shm import ShmPublisher, ShmSubscriber  # noqa: E402

MODELS = {
    "10M": dict(vocab=8192, hidden=256, layers=8, inter=1024, tied=False),
    "100M": dict(vocab=32000, hidden=640, layers=12, inter=2560, tied=True),
}


def model_shapes(vocab: int, hidden: int, layers: int, inter: int, tied: bool) -> dict[str, tuple]:
    """Parameter shapes of a Llama/Qwen-style decoder (GQA with half as many KV heads)."""
    kv = hidden // 2
    shapes = {"embed.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm.weight": (hidden,),
            p + "q_proj.weight": (hidden, hidden),
            p + "k_proj.weight": (kv, hidden),
            p + "v_proj.weight": (kv, hidden),
            p + "o_proj.weight": (hidden, hidden),
            p + "mlp_norm.weight": (hidden,),
            p + "gate_proj.weight": (inter, hidden),
            p + "up_proj.weight": (inter, hidden),
            p + "down_proj.weight": (hidden, inter),
        }
    shapes["norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def bench_size(shapes: dict[str, tuple], reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    actor = {n: torch.empty(s) for n, s in shapes.items()}
    numel = sum(t.numel() for t in params.values())
    src, dst = torch.randn(numel, generator=gen), torch.empty(numel)
    pub_s, apply_s, copy_s = [], [], []
    with tempfile.TemporaryDirectory() as run_dir:
        pub = ShmPublisher(run_dir, params)
        sub = ShmSubscriber(run_dir, timeout_s=5)
        for rep in range(reps + 1):  # rep 0 warms caches and page tables, not recorded
            t0 = time.perf_counter()
            dst.copy_(src)
            t1 = time.perf_counter()
            pub.publish(rep, params)
            t2 = time.perf_counter()
            assert sub.apply(actor) == rep
            t3 = time.perf_counter()
            if rep:
                copy_s.append(t1 - t0)
                pub_s.append(t2 - t1)
                apply_s.append(t3 - t2)
        exact = all(torch.equal(actor[n], params[n]) for n in params)
        sub.close()
        pub.close()
    p, a, c = (statistics.median(x) for x in (pub_s, apply_s, copy_s))
    return {
        "params": numel, "mb": numel * 4 / 2**20, "tensors": len(shapes),
        "publish_ms": p * 1e3, "apply_ms": a * 1e3, "sync_ms": (p + a) * 1e3, "memcpy_ms": c * 1e3,
        "ratio": (p + a) / c, "gbps": numel * 4 / (p + a) / 1e9, "exact": exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every copy")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    load = os.getloadavg()[0]
    results = {name: bench_size(model_shapes(**cfg), args.reps) for name, cfg in MODELS.items()}

    cols = ["size", "params", "MiB", "tensors", "publish ms", "apply ms", "pub+apply ms", "memcpy ms", "ratio"]
    print(f"weightsync shm vs memcpy  (threads={args.threads}, median of {args.reps} reps, "
          f"load average {load:.1f} on {os.cpu_count()} cpus: other load skews both sides)")
    print("  ".join(f"{c:>12}" for c in cols))
    for name, r in results.items():
        row = [name, f"{r['params'] / 1e6:.1f}M", f"{r['mb']:.0f}", r["tensors"], f"{r['publish_ms']:.2f}",
               f"{r['apply_ms']:.2f}", f"{r['sync_ms']:.2f}", f"{r['memcpy_ms']:.2f}", f"{r['ratio']:.2f}"]
        print("  ".join(f"{str(v):>12}" for v in row))
    if not all(r["exact"] for r in results.values()):
        print("ERROR: applied weights differ from the published ones")
    worst = max(results.values(), key=lambda r: r["ratio"])["ratio"]
    print(f"worst (publish+apply)/memcpy = {worst:.2f}  (target <= 2.0; two copies make ~2 the floor)")
    sizes = {k: {m: (round(v, 4) if isinstance(v, float) else v) for m, v in r.items()} for k, r in results.items()}
    print(json.dumps({"bench": "weightsync", "ratio": round(worst, 3), "target": 2.0, "threads": args.threads,
                      "reps": args.reps, "load_avg": round(load, 2), "sizes": sizes}))


if __name__ == "__main__":
    main()
