"""Cost of the learner's FP32-island log-prob recompute against a bare forward, side by side.

learner:   ``TorchBackend.logprobs`` under no_grad with the default precision policy -- body matmuls in
           bf16 under autocast, attention softmax in FP32, LM head + log-softmax in FP32, chunked
           (ARCHITECTURE.md: Precision and the ratio). Exactly what the trainer runs for the numerator.
bare:      the same FP32 model, plain forward + full ``[N, L-1, V]`` FP32 logits; no autocast, no
           chunking, no log-softmax. The cheapest pass that could produce the numerator at all.
bf16_all:  ``TorchBackend.logprobs`` with every island off (bf16 body, bf16 softmax, bf16 head).
fp32_all:  ``TorchBackend.logprobs`` with an FP32 body (islands moot): isolates what autocast costs.
no_fp32_softmax / no_fp32_head: the learner with one island switched off, to price each one.

Model: the default tiny CPU model (``jobs.resolve_model``, cached in .cache/driftrl; built
on first use). Batches: 8 groups x 8 completions sampled by the engine
(the default run's step batch, ~16 tokens a row), plus a synthetic batch of longer rows. Every
variant runs once per round in a rotating order (so background load hits all alike); the table
shows medians. Last line: ``{"bench": "logprobs", "cost_ratio": learner/bare, ...}`` on the
engine batch.

    python bench/logprobs.py [--reps 200] [--threads 1] [--long-rows 64 --long-len 128 --long-reps 30]
                             [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.common import engine_batch  # noqa: E402
from core import config as C  # noqa: E402
from learner.backends.torch import TorchBackend  # noqa: E402
from learner.batching import Batch  # noqa: E402
from model.hf import load_pretrained  # noqa: E402
from jobs import resolve_model  # noqa: E402

VARIANTS = {  # name -> learner config overrides (None: the bare forward)
    "learner": [],
    "bare": None,
    "bf16_all": ["learner.fp32_attn_softmax=false", "learner.fp32_head=false"],
    "fp32_all": ["learner.body_dtype=\"float32\""],
    # one island off at a time: what each of them costs
    "no_fp32_softmax": ["learner.fp32_attn_softmax=false"],
    "no_fp32_head": ["learner.fp32_head=false"],
}


def synthetic_batch(rows: int, length: int, vocab: int, prompt_len: int = 8) -> Batch:
    """Full-length random rows: prompt_len context tokens, the rest scored (no padding)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    mask[:, prompt_len - 1:] = 1.0
    return Batch(ids=ids, key_mask=torch.ones(rows, length, dtype=torch.bool), mask=mask,
                 behaviour_logp=torch.zeros(rows, length - 1), rewards=torch.zeros(rows // 8 or 1, 8),
                 staleness=torch.zeros(rows, dtype=torch.long), keys=[], num_tokens=int(mask.sum()))


def make_runners(model_dir: str):
    """name -> f(batch); each variant owns its own copy of the weights."""
    runners = {}
    for name, overrides in VARIANTS.items():
        if overrides is None:
            runners[name] = partial(bare_forward, load_pretrained(model_dir).eval())
        else:
            trainer = TorchBackend(C.load(None, overrides), model_dir)
            trainer.model.eval()
            runners[name] = lambda batch, t=trainer: t.logprobs(batch)[0]
    return runners


def bare_forward(model, batch: Batch) -> torch.Tensor:
    ids = batch.ids
    pos = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
    return model.logits(model(ids[:, :-1], pos, batch.key_mask[:, :-1]))


def time_all(runners, batch, reps: int, warmup: int = 5) -> dict[str, float]:
    names = list(runners)
    times = {n: [] for n in names}
    with torch.no_grad():
        for _ in range(warmup):
            for n in names:
                runners[n](batch)
        for r in range(reps):
            for n in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
                t0 = time.perf_counter()
                runners[n](batch)
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def profile(runners, batch, names=("learner", "bare")) -> None:
    from torch.profiler import ProfilerActivity, profile as tprofile

    for n in names:
        with torch.no_grad(), tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                runners[n](batch)
        print(f"\n--- profile: {n} (50 calls) ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--long-rows", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=128)
    ap.add_argument("--long-reps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables (engine batch)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = resolve_model(C.load())
    model_dir = cfg.model.path
    runners = make_runners(model_dir)
    batches = {"engine": engine_batch(cfg)}
    vocab = load_pretrained(model_dir).cfg.vocab_size
    if args.long_rows:
        batches["long"] = synthetic_batch(args.long_rows, args.long_len, vocab)

    reps = {"engine": args.reps, "long": args.long_reps}
    med = {b: time_all(runners, batch, reps[b]) for b, batch in batches.items()}
    arch = load_pretrained(model_dir).cfg
    print(f"model {os.path.basename(model_dir)}: hidden {arch.hidden_size}, layers {arch.num_hidden_layers}, "
          f"vocab {arch.vocab_size}; torch {torch.__version__}, {args.threads} thread(s)")
    for b, batch in batches.items():
        print(f"batch {b}: {batch.ids.shape[0]} rows x {batch.ids.shape[1]} tokens, {batch.num_tokens} scored, "
              f"median of {reps[b]} interleaved rounds")
    print(f"{'variant':<18}" + "".join(f"{b + ' ms':>12}{'/bare':>8}" for b in batches))
    for n in VARIANTS:
        print(f"{n:<18}" + "".join(f"{med[b][n] * 1e3:>12.3f}{med[b][n] / med[b]['bare']:>8.2f}" for b in batches))
    if args.profile:
        profile(runners, batches["engine"])

    e = med["engine"]
    out = {"bench": "logprobs", "cost_ratio": round(e["learner"] / e["bare"], 3),
           **{f"{n}_ratio": round(e[n] / e["bare"], 3) for n in VARIANTS if n not in ("learner", "bare")},
           **{f"{n}_ms": round(e[n] * 1e3, 4) for n in VARIANTS},
           "engine_batch": list(batches["engine"].ids.shape), "threads": args.threads, "reps": args.reps}
    if "long" in med:
        lg = med["long"]
        out.update({f"long_{n}_ratio": round(lg[n] / lg["bare"], 3) for n in VARIANTS if n != "bare"},
                   long_bare_ms=round(lg["bare"] * 1e3, 3), long_batch=list(batches["long"].ids.shape))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
