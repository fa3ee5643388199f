"""What context parallelism (model/context_parallel.py) buys and costs: per-rank peak memory and time of
one learner step (``TorchBackend.forward_backward`` + ``optim_step``) against sequence length, CP = 1
against CP = 2 (two processes, a Gloo group on 127.0.0.1), and the collectives each attention layer
waits on in sequence: the all-to-all there and the one back (2 at any CP), where ring attention
passes KV chunks CP - 1 times.

Every (CP, length) runs in fresh processes. A rank's peak is its ``ru_maxrss`` after the measured
step minus its resident size just before it (model, optimiser state and a short warm-up step
already in place), so it is what the step itself adds: activations, the attention scores, the
gradients; the table shows the largest over ranks, and the slowest rank's time of that step. Model: a
random Llama-shaped decoder (FP32 body, 8 query / 2 KV heads); batch: one group of 2 rows, the
second 3/4 as long (padded), all but the first 16 tokens scored, one micro-batch.

    python bench/context_parallel.py [--lengths 1024 2048 4096] [--threads 1] [--layers 2]

Last line: ``{"bench": "context_parallel", "peak_ratio_longest": CP2/CP1, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core import config as C  # noqa: E402
from learner.backends.torch import TorchBackend  # noqa: E402
from learner.batching import Batch  # noqa: E402
from model import context_parallel  # noqa: E402
from model.arch import ArchConfig  # noqa: E402
from model.decoder import Decoder  # noqa: E402

PROMPT = 16


def _model(layers: int) -> Decoder:
    torch.manual_seed(0)
    return Decoder(ArchConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=32, model_type="llama",
                              max_position_embeddings=65536))


def _batch(length: int, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(length)
    key_mask = torch.arange(length)[None] < torch.tensor([length, length * 3 // 4])[:, None]
    ids = torch.randint(1, vocab, (2, length), generator=g) * key_mask
    mask = (key_mask[:, 1:] & (torch.arange(1, length) >= PROMPT)[None]).float()
    return Batch(ids=ids, key_mask=key_mask, mask=mask, behaviour_logp=-8.0 * mask, rewards=torch.tensor([[1.0, 0.0]]),
                 staleness=torch.zeros(2, dtype=torch.long), keys=[], num_tokens=int(mask.sum()))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _step(backend: TorchBackend, batch: Batch) -> float:
    t = time.perf_counter()
    backend.forward_backward(batch)
    backend.optim_step()
    return time.perf_counter() - t


def _count_all_to_all(backend: TorchBackend, batch: Batch) -> float:
    """All-to-all calls per attention layer in one forward (a no-grad log-prob pass)."""
    calls, real = [0], dist.all_to_all_single
    context_parallel.dist.all_to_all_single = lambda *a, **k: (calls.__setitem__(0, calls[0] + 1), real(*a, **k))[1]
    try:
        with torch.no_grad():
            backend.logprobs(batch)
    finally:
        context_parallel.dist.all_to_all_single = real
    return calls[0] / backend.arch.num_hidden_layers


def worker(rank: int, size: int, port: int, length: int, args) -> dict:
    torch.set_num_threads(args.threads)
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    cfg = C.load(None, ["learner.body_dtype=float32", "learner.device=cpu", "learner.micro_batch_tokens=0",
                        f"learner.context_parallel={size}"])
    backend = TorchBackend(cfg, "", model=_model(args.layers))
    _step(backend, _batch(64, 4096))  # warm-up: kernels, allocator, AdamW's state
    batch, before = _batch(length, 4096), _rss_mb()
    step_s = _step(backend, batch)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before  # KiB on Linux
    out = {"rank": rank, "peak_mb": peak_mb, "step_s": step_s}
    if size > 1:
        out["all_to_all_per_layer"] = _count_all_to_all(backend, batch)
    return out


def run(size: int, length: int, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(args.threads), "--layers", str(args.layers),
           "--worker", str(size), str(port), str(length)]
    # glibc returns every buffer of 128 KiB and up to the system when freed: the RSS follows live tensors
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "131072"}
    procs = [subprocess.Popen([*cmd, str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in range(size)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"CP={size} length {length}: a rank failed ({[p.returncode for p in procs]})")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--worker", type=int, nargs=4, metavar=("SIZE", "PORT", "LENGTH", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        size, port, length, rank = args.worker
        print(json.dumps(worker(rank, size, port, length, args)))
        return
    params = sum(p.numel() for p in _model(args.layers).parameters())
    print(f"model: {params / 1e6:.1f}M parameters, {args.layers} layers, 8 query / 2 KV heads; "
          f"{args.threads} thread(s) per rank; peak = what one step adds, largest over ranks")
    print(f"{'tokens':>8}{'CP=1 MB':>10}{'CP=2 MB':>10}{'ratio':>8}{'CP=1 s':>9}{'CP=2 s':>9}")
    res = {1: [], 2: []}
    for length in args.lengths:
        for size in (1, 2):
            ranks = run(size, length, args)
            worst = {"peak_mb": max(r["peak_mb"] for r in ranks), "step_s": max(r["step_s"] for r in ranks)}
            res[size].append({**worst, **({"a2a": ranks[0]["all_to_all_per_layer"]} if size > 1 else {})})
        one, two = res[1][-1], res[2][-1]
        print(f"{length:>8}{one['peak_mb']:>10.0f}{two['peak_mb']:>10.0f}{two['peak_mb'] / one['peak_mb']:>8.2f}"
              f"{one['step_s']:>9.2f}{two['step_s']:>9.2f}")
    a2a = res[2][-1]["a2a"]
    print(f"sequential collectives per attention layer and pass at CP=2: all-to-all {a2a:g} (there and back, "
          f"any CP); ring attention CP-1 = 1 KV step (7 at CP=8)")
    print(json.dumps({"bench": "context_parallel", "params": params, "layers": args.layers, "threads": args.threads,
                      "lengths": args.lengths, "cp1": res[1], "cp2": res[2],
                      "peak_ratio_longest": res[2][-1]["peak_mb"] / res[1][-1]["peak_mb"],
                      "all_to_all_per_layer": a2a, "ring_steps_per_layer": 1}))


if __name__ == "__main__":
    main()
