"""Bench: a weight update through the shm transport (weights as versioned files in /dev/shm,
weightsync/files.py) vs. a plain memory copy of the same bytes.

For two float32 decoder-shaped models (~10M and ~100M parameters) it times, in one process and
interleaved rep by rep so every figure sees the same machine load:

* ``publish``      learner tensors -> a version file (``ShmPublisher.publish``, the one bulk copy:
                   ``pwrite`` into a reused file, which the learner never maps; a rename, a symlink)
* ``apply``        what the default fp32 actor does: map the newest file (``ShmSubscriber.apply``
                   rebinding each Parameter's ``.data``; O(tensors), no bytes move)
* ``apply copy``   copy mode (``zero_copy=False``; what a dtype-converting actor, e.g. bf16, or
                   a GPU actor does): ``preadv`` from the file into the actor's own tensors
* ``memcpy``       ``dst.copy_(src)`` of one flat buffer holding the same number of bytes
* ``first touch``  not in ``ratio``: reading one byte of every page of the mapped weights right
                   after a mapped apply, minus the same read again. A new version is a new mapping,
                   so the actor's next forward takes these page faults (and a later apply unmaps
                   what it touched) -- the mapped mode's deferred cost.

``ratio`` = (publish + apply) / memcpy in the default (mapped) mode for the worst size; the
target is <= 1.2. ``ratio_copy_mode`` is the same for copy mode, two copies, so ~2 at best.
Medians over ``--reps``. Last line: one JSON object with the figures.

``--delta`` measures delta publishing instead (weightsync/delta.py): a ~100M-parameter decoder (HF-style
init, std 0.02) takes real AdamW steps at an RL learning rate (``--lr``, 1e-6) on FP32 master weights, and
each step publishes a BF16 version through shm with ``weightsync.delta`` on. Three subscribers: one applies
every version, one only every 7th (it walks the deltas it missed), one joins at 3/5 of the versions. After
``--versions`` (50) each must hold, bit for bit, what a full publish of the master weights in BF16 gives.
``sent_frac`` = bytes published per version / a full version's bytes (target <= 0.1).

    python bench/weightsync.py [--reps 9] [--threads 1]
    python bench/weightsync.py --delta [--versions 50] [--lr 1e-6] [--threads 2]
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

from core.config import WeightSyncSection  # noqa: E402
from model.arch import ArchConfig  # noqa: E402
from model.decoder import Decoder  # noqa: E402
from weightsync.files import ShmPublisher, ShmSubscriber  # noqa: E402

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


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def bench_size(shapes: dict[str, tuple], reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    # the actor's tensors are its model's Parameters (actor/engine.py: TorchEngine.params)
    mapped = {n: torch.nn.Parameter(torch.empty(s), requires_grad=False) for n, s in shapes.items()}
    copied = {n: torch.empty(s) for n, s in shapes.items()}
    numel = sum(t.numel() for t in params.values())
    src, dst = torch.randn(numel, generator=gen), torch.empty(numel)
    t = {k: [] for k in ("memcpy", "publish", "apply", "publish_c", "apply_c")}
    with tempfile.TemporaryDirectory() as run_dir:
        pub = ShmPublisher(run_dir, params)
        sub_map = ShmSubscriber(run_dir, timeout_s=5)
        sub_copy = ShmSubscriber(run_dir, timeout_s=5, zero_copy=False)
        for rep in range(reps + 1):  # rep 0 warms caches and page tables, not recorded
            t0 = time.perf_counter()
            dst.copy_(src)
            t1 = time.perf_counter()
            pub.publish(2 * rep, params)
            t2 = time.perf_counter()
            assert sub_map.apply(mapped) == 2 * rep and sub_map.stats.mapped == len(shapes)
            t3 = time.perf_counter()
            pub.publish(2 * rep + 1, params)
            t4 = time.perf_counter()
            assert sub_copy.apply(copied) == 2 * rep + 1 and sub_copy.stats.mapped == 0
            t5 = time.perf_counter()
            if rep:
                for k, a, b in (("memcpy", t0, t1), ("publish", t1, t2), ("apply", t2, t3),
                                ("publish_c", t3, t4), ("apply_c", t4, t5)):
                    t[k].append(b - a)
        exact = all(torch.equal(mapped[n], params[n]) and torch.equal(copied[n], params[n]) for n in params)
        touch = _deferred_cost(pub, sub_map, params, mapped, 2 * reps + 2)
        skipped = pub.skipped
        sub_map.close()
        sub_copy.close()
        pub.close()
    ms = {k: _median_ms(v) for k, v in t.items()}
    return {
        "params": numel, "mb": numel * 4 / 2**20, "tensors": len(shapes), "memcpy_ms": ms["memcpy"],
        "publish_ms": ms["publish"], "apply_ms": ms["apply"], "sync_ms": ms["publish"] + ms["apply"],
        "ratio": (ms["publish"] + ms["apply"]) / ms["memcpy"],
        "copy_publish_ms": ms["publish_c"], "copy_apply_ms": ms["apply_c"],
        "ratio_copy_mode": (ms["publish_c"] + ms["apply_c"]) / ms["memcpy"],
        "gbps": numel * 4 / (ms["publish"] + ms["apply"]) / 1e6, "exact": exact, "skipped": skipped, **touch,
    }


def _touch(tensors: dict[str, torch.Tensor]) -> float:
    """Seconds to read one float of every 4 KiB page of ``tensors``."""
    t0 = time.perf_counter()
    for t in tensors.values():
        float(t.reshape(-1)[::1024].sum())
    return time.perf_counter() - t0


def _deferred_cost(pub, sub, params, mapped, version: int) -> dict:
    """What a mapped apply leaves to the actor: page faults at its first forward (the first read
    minus a second one), and an apply that unmaps a touched version (median of 3)."""
    faults, unmaps = [], []
    for v in range(version, version + 3):
        pub.publish(v, params)
        t0 = time.perf_counter()
        assert sub.apply(mapped) == v
        unmaps.append(time.perf_counter() - t0)
        faults.append(_touch(mapped) - _touch(mapped))
    return {"first_touch_ms": _median_ms(faults), "apply_after_touch_ms": _median_ms(unmaps[1:])}


def _decoder_100m() -> Decoder:
    cfg = ArchConfig(vocab_size=32000, hidden_size=640, intermediate_size=2560, num_hidden_layers=12,
                     num_attention_heads=10, num_key_value_heads=5, head_dim=64, max_position_embeddings=256,
                     model_type="llama")
    model = Decoder(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # a checkpoint's scale: an element's BF16 step is ~0.4 % of it, an Adam step ~lr
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def _train_step(model: Decoder, opt, gen) -> None:
    ids = torch.randint(0, model.cfg.vocab_size, (2, 65), generator=gen)
    pos = torch.arange(64).expand(2, 64)
    hidden = model(ids[:, :-1], pos, torch.ones(2, 64, dtype=torch.bool))
    loss = torch.nn.functional.cross_entropy(model.logits(hidden).flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def bench_delta(versions: int, lr: float) -> dict:
    model = _decoder_100m()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    named = lambda: {k: v.detach() for k, v in model.state_dict().items()}  # noqa: E731
    bf16 = lambda: {k: v.to(torch.bfloat16) for k, v in named().items()}  # noqa: E731
    gen, pub_s, apply_s, step_s = torch.Generator().manual_seed(1), [], [], []
    with tempfile.TemporaryDirectory() as run_dir:
        pub = ShmPublisher(run_dir, bf16())
        pub.use_delta(WeightSyncSection().full_every, torch.bfloat16)
        subs = {"every": ShmSubscriber(run_dir, 5, zero_copy=False), "missed": ShmSubscriber(run_dir, 5, zero_copy=False)}
        held = {k: bf16() for k in ("every", "missed", "late")}
        changed, delta_bytes = [], []
        for v in range(versions):
            if v:
                t0 = time.perf_counter()
                _train_step(model, opt, gen)
                step_s.append(time.perf_counter() - t0)
            stats = pub.publish(v, named())
            pub_s.append(stats.seconds)
            if v:
                changed.append(pub.delta.changed_frac)
                delta_bytes.append(stats.bytes)
            if v == versions * 3 // 5:
                subs["late"] = ShmSubscriber(run_dir, 5, zero_copy=False)
            t0 = time.perf_counter()
            assert subs["every"].apply(held["every"]) == v
            apply_s.append(time.perf_counter() - t0)
            if v % 7 == 6:
                subs["missed"].apply(held["missed"])
            if "late" in subs and v % 3 == 0:
                subs["late"].apply(held["late"])
        for name, sub in subs.items():
            sub.apply(held[name])
        want = bf16()
        exact = {k: all(torch.equal(h[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
                 for k, h in held.items()}
        versions_held = {k: s.stats.last_version for k, s in subs.items()}
        full = layout_bytes = sum(t.numel() * t.element_size() for t in want.values())
        out = {"params": sum(t.numel() for t in want.values()), "versions": versions, "lr": lr,
               "full_bytes": layout_bytes, "full_versions": pub.fulls, "sent_frac": pub.sent / (pub.versions * full),
               "delta_frac_median": statistics.median(b / full for b in delta_bytes if b < full),
               "changed_frac_median": statistics.median(changed), "changed_frac_max": max(changed),
               "publish_ms_median": _median_ms(pub_s[1:]), "apply_ms_median": _median_ms(apply_s[1:]),
               "train_step_ms_median": _median_ms(step_s), "exact": exact, "versions_held": versions_held}
        for sub in subs.values():
            sub.close()
        pub.close()
    return out


def main_delta(args) -> None:
    r = bench_delta(args.versions, args.lr)
    print(f"delta publishing: {r['params'] / 1e6:.0f}M parameters, BF16 versions, AdamW lr={r['lr']:g}, "
          f"{r['versions']} versions ({r['full_versions']} full)")
    print(f"changed per step: median {r['changed_frac_median']:.2%} of elements (max {r['changed_frac_max']:.2%}); "
          f"a delta is {r['delta_frac_median']:.2%} of a full version; sent per version {r['sent_frac']:.2%} "
          "(target <= 10%)")
    print(f"publish {r['publish_ms_median']:.0f} ms (cast, compare, write), apply {r['apply_ms_median']:.1f} ms, "
          f"train step {r['train_step_ms_median']:.0f} ms")
    print("bit-exact against a full publish: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["exact"].items()))
    print(json.dumps({"bench": "weightsync_delta", **{k: round(v, 5) if isinstance(v, float) and k != "lr" else v
                                                      for k, v in r.items()}, "target": 0.1}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every copy")
    ap.add_argument("--delta", action="store_true", help="measure delta publishing (see the module docstring)")
    ap.add_argument("--versions", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.delta:
        return main_delta(args)

    load = os.getloadavg()[0]
    results = {name: bench_size(model_shapes(**cfg), args.reps) for name, cfg in MODELS.items()}

    cols = ["size", "params", "MiB", "tensors", "memcpy ms", "publish ms", "apply ms", "ratio",
            "copy pub ms", "copy apply ms", "copy ratio", "1st touch ms"]
    print(f"weightsync shm vs memcpy  (threads={args.threads}, median of {args.reps} reps, "
          f"load average {load:.1f} on {os.cpu_count()} cpus: other load skews both sides)")
    print("apply = the default fp32 actor's zero-copy mapping; copy = zero_copy=False (bf16/GPU actors)")
    print("  ".join(f"{c:>13}" for c in cols))
    for name, r in results.items():
        row = [name, f"{r['params'] / 1e6:.1f}M", f"{r['mb']:.0f}", r["tensors"], f"{r['memcpy_ms']:.2f}",
               f"{r['publish_ms']:.2f}", f"{r['apply_ms']:.3f}", f"{r['ratio']:.2f}", f"{r['copy_publish_ms']:.2f}",
               f"{r['copy_apply_ms']:.2f}", f"{r['ratio_copy_mode']:.2f}", f"{r['first_touch_ms']:.2f}"]
        print("  ".join(f"{str(v):>13}" for v in row))
    if not all(r["exact"] for r in results.values()):
        print("ERROR: applied weights differ from the published ones")
    if any(r["skipped"] for r in results.values()):
        print("ERROR: the publisher skipped versions")
    worst = max(r["ratio"] for r in results.values())
    worst_copy = max(r["ratio_copy_mode"] for r in results.values())
    print(f"worst (publish+apply)/memcpy = {worst:.2f} mapped (target <= 1.2), "
          f"{worst_copy:.2f} copy mode (two copies: ~2 is its floor); the mapped mode's page faults "
          "(1st touch) come on top, in the actor's next forward")
    sizes = {k: {m: (round(v, 4) if isinstance(v, float) else v) for m, v in r.items()} for k, r in results.items()}
    print(json.dumps({"bench": "weightsync", "ratio": round(worst, 3), "ratio_copy_mode": round(worst_copy, 3),
                      "target": 1.2, "mode": "mapped", "threads": args.threads, "reps": args.reps,
                      "load_avg": round(load, 2), "sizes": sizes}))


if __name__ == "__main__":
    main()
