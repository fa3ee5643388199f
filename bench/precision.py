"""Controlled precision ablation: ONE fixed set of sampled completions, scored by the learner
under each precision policy against the SAME behaviour log-probs.

    python bench/precision.py [--actor-dtype bfloat16] [--prompts 8 --group 4 --response-len 128]
                              [--vocab 32768 --hidden 256 --layers 4 --heads 4 --kv-heads 2
                               --head-dim 64 --intermediate 768] [--qk-gain 3.5 --out-gain 0.3
                               --head-gain 4.5] [--time-groups 1 --time-reps 3] [--threads 1]
                              [--model DIR] [section.key=value ...]

Defaults take ~4 min on 2 AVX2 cores; scale up with e.g. ``--hidden 512 --layers 6 --prompts 16``.

Why not two training runs: two asynchronous runs differ in timing (staleness, which groups meet
which weights), so a 1-2 % difference in their ratio tails cannot be attributed to precision.
Here nothing but the learner's precision policy changes between the columns:

1. a model with a real vocabulary (``--vocab 32768``): a random-initialised HF-format Llama
   written by ``model.hf.save_pretrained`` into a temporary directory (or ``--model DIR``). A
   std-0.02 init gives near-uniform next-token distributions (entropy ~ log V), every ratio ~ 1
   and nothing to measure, so the init is scaled like a trained LM's numerics
   (:func:`init_weights`): the LM head so the sampled positions' entropy is a few nats, q/k so
   the attention logits |q.k|/sqrt(d) are of order 10 (BF16's 8-bit mantissa rounds a score of
   30 by up to 0.06). Random q/k with scores that large make a chaotic model -- near-ties between
   keys flip under any rounding, and at o/down gain 1 every policy's log-probs differ from the
   reference by ~0.3 nats, far beyond a trained LM's ~0.01-0.05 -- so each layer's output is
   scaled down (``--out-gain 0.3``) until the actor-vs-FP32 mismatch is of that order. The
   measured entropy and attention-logit scale are printed and land in the JSON line;
2. completions sampled once by the embedded engine (``actor/engines/torch.py``) in
   ``--actor-dtype`` (``actor.dtype``, the actor's default precision, bfloat16), exactly
   ``--response-len`` tokens each: the engine gets no stop id, so no completion ends early. Its
   behaviour log-probs are the fixed denominators of every column;
3. the same tokens scored by ``TorchBackend.logprobs`` (the learner's numerator, exactly as it
   trains) under five policies, each a fresh backend on the same checkpoint:

   ============  ================  ==================  ===========
   policy        learner.body      fp32_attn_softmax   fp32_head
   ============  ================  ==================  ===========
   fp32          float32           (moot)              (moot)       the reference
   islands       bfloat16          true                true         the default
   head_only     bfloat16          false               true
   softmax_only  bfloat16          true                false
   bf16          bfloat16          false               false
   ============  ================  ==================  ===========

How to read it. ``ratio_*`` and ``kl_k3`` / ``abs_logp_diff_*`` (``learner/ratio_metrics.py``,
over the completion tokens) compare each policy with the *actor*: they include the actor's own
BF16 error, which no learner policy can remove, so ``fp32`` is the floor. ``vs_fp32_abs_logp_p99``
compares each policy with the ``fp32`` policy on the same tokens: the learner's own numerical
error, the part the islands are there to remove (0 for ``fp32`` by construction).
``ms_per_step`` is the median of ``--time-reps`` timed ``TorchBackend.forward_backward`` +
``discard_grads`` (Ring-Zero loss, seeded 0/1 rewards) on the first
``--time-groups`` groups of the same completions, collated as the learner receives them: a whole
step over every scored token would take minutes per policy on a CPU without native BF16.
Timings depend on the CPU: the JSON line names its BF16-relevant flags (AVX2-only cores run BF16
matmuls several times slower than FP32, so ``bf16`` is the slowest column there).

Measured (2-core AMD EPYC, AVX2 only, 1 thread, defaults; 4,096 tokens, entropy 3.38 nats,
attention logits mean 9.8 / p99 32), fp32 / islands / head_only / softmax_only / bf16:
|dlogp| p99 vs fp32 0 / 0.190 / 0.260 / 0.228 / 0.273; k3 vs the actor 3.07e-3 / 3.47e-3 /
4.41e-3 / 4.52e-3 / 5.40e-3; ratio p99 1.240 / 1.265 / 1.298 / 1.280 / 1.310; a timed step
1.8 / 5.6 / 5.9 / 28.1 / 22.2 s (bench/README.md reads them).

The last stdout line is one JSON object: ``{"bench": "precision", "policies": {"fp32": {...},
"islands": {...}, "head_only": {...}, "softmax_only": {...}, "bf16": {...}}, "model": {...},
"tokens_scored": ..., "mean_entropy": ..., "attn_logit_abs_mean": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.common import bench_config, format_table, json_safe, load_avg  # noqa: E402
from core import messages as M  # noqa: E402
from learner.backends.torch import TorchBackend  # noqa: E402
from learner.batching import collate  # noqa: E402
from learner.ratio_metrics import percentiles, ratio_metrics  # noqa: E402
from model.arch import ArchConfig  # noqa: E402
from model.decoder import Decoder  # noqa: E402
from model.hf import load_pretrained, read_config, save_pretrained  # noqa: E402

# name -> (learner.body_dtype, learner.fp32_attn_softmax, learner.fp32_head); fp32 first: the
# other policies are compared with its log-probs
POLICIES = {
    "fp32": ("float32", True, True),
    "islands": ("bfloat16", True, True),
    "head_only": ("bfloat16", False, True),
    "softmax_only": ("bfloat16", True, False),
    "bf16": ("bfloat16", False, False),
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
PAD = 0
PROMPT_LENGTHS = (8, 24)


# ---- the model ---------------------------------------------------------------------------------


def arch_config(args) -> ArchConfig:
    """A Llama (untied head, GQA, no q/k-norm: the q/k init alone sets the attention-logit scale)."""
    return ArchConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=max(256, PROMPT_LENGTHS[1] + args.response_len),
                      tie_word_embeddings=False, model_type="llama", pad_token_id=PAD)


def _init_std(name: str, shape, args) -> float | None:
    """Std of one weight (None: keep it, the norms' ones). Fan-in scaling keeps a projection's
    output at the scale of its input (RMSNorm'd activations: ~1 per component) times its gain:
    q/k get ``qk_gain`` each, so a score q.k/sqrt(d) has std ~ qk_gain^2; o/down get
    ``out_gain``, each layer's share of the residual stream (against embeddings of std
    ``embed_std``), which bounds how far a rounding-flipped attention pattern moves the output;
    the head gets ``head_gain``, the std of the logits, which sets how peaked the next-token
    distributions are."""
    if name.endswith("embed_tokens.weight"):
        return args.embed_std
    if name == "lm_head.weight":
        return args.head_gain / math.sqrt(shape[1])
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return args.qk_gain / math.sqrt(shape[1])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return args.out_gain / math.sqrt(shape[1])
    if name.endswith("proj.weight"):
        return 1.0 / math.sqrt(shape[1])
    return None


def init_weights(model: Decoder, args) -> None:
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = _init_std(name, p.shape, args)
            if std is not None:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def build_checkpoint(path: str, args) -> None:
    model = Decoder(arch_config(args))
    init_weights(model, args)
    save_pretrained(model, path)


# ---- the fixed completions ----------------------------------------------------------------------


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(*PROMPT_LENGTHS))] for _ in range(n)]


def sample_groups(cfg, model_dir: str, prompts: list[list[int]]) -> tuple[list, float]:
    """``group_size`` samples of every prompt from a TorchEngine as the actor builds it
    (``TorchEngine.from_config``'s arguments, in ``actor.dtype`` with its attention island), but
    with no stop ids, so every completion is exactly ``actor.max_new_tokens`` long."""
    from actor.engines.torch import TorchEngine
    from model.sampling import SamplingSpec

    a, size = cfg.actor, cfg.actor.group_size
    engine = TorchEngine(load_pretrained(model_dir), SamplingSpec.of(a), eos_ids=[], pad_id=PAD,
                         max_new_tokens=a.max_new_tokens, max_batch=a.max_batch, dtype=a.dtype,
                         fp32_attn_softmax=a.fp32_attn_softmax, seed=cfg.run.seed)
    t0 = time.perf_counter()
    flat = engine.generate([p for p in prompts for _ in range(size)])
    seconds = time.perf_counter() - t0
    short = sorted({len(s.tokens) for s in flat} - {a.max_new_tokens})
    if short:
        raise RuntimeError(f"completions of {short} tokens, not actor.max_new_tokens={a.max_new_tokens}")
    rng = random.Random(cfg.run.seed)  # 0/1 rewards: non-zero advantages, so the timed backward is real
    groups = [M.group_from_samples(flat[i * size:(i + 1) * size], [float(rng.random() < 0.5) for _ in range(size)],
                                   actor_id="bench", seq=i, group_id=f"p{i}", task="precision", tier="0",
                                   prompt=p, start_version=0)
              for i, p in enumerate(prompts)]
    return groups, seconds


# ---- scoring -------------------------------------------------------------------------------------


def policy_overrides(name: str) -> list[str]:
    body, softmax, head = POLICIES[name]
    return [f'learner.body_dtype="{body}"', f"learner.fp32_attn_softmax={str(softmax).lower()}",
            f"learner.fp32_head={str(head).lower()}"]


def time_steps(backend: TorchBackend, batch, reps: int) -> float:
    """Median ms of ``forward_backward`` + ``discard_grads`` over ``reps`` runs. No separate
    warm-up: the backend's ``logprobs`` has run the forward already, and the median of 3 drops a
    slow first backward (a bf16 step is seconds here; one more would add a minute to the bench)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        backend.forward_backward(batch)
        backend.discard_grads()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def compare(logp, ref, behaviour, mask) -> dict:
    """The bench's names for ``ratio_metrics`` (learner vs behaviour) plus the gap to ``ref``."""
    m = ratio_metrics(logp, behaviour, mask)
    sel = mask > 0
    gap = (logp - ref)[sel].abs()
    out = {k.split("/")[1] if k.startswith("mismatch/") else k.replace("ratio/", "ratio_"): v for k, v in m.items()}
    out["vs_fp32_abs_logp_mean"] = float(gap.double().mean())
    out["vs_fp32_abs_logp_p99"] = percentiles(gap, [99.0])[0]
    out["vs_fp32_abs_logp_max"] = float(gap.max())
    return out


def attention_logit_scale(backend: TorchBackend, batch) -> dict:
    """|q.k|/sqrt(d) over the allowed (causal, non-pad) pairs of one learner forward, read from
    the q and k each layer hands its cache-free attention (wrapped for this one call)."""
    seen = []
    layers = [layer.self_attn for layer in backend.model.model.layers]

    def wrap(attn):
        inner = attn._attend_full

        def spy(q, k, v, bias, *rest, **kw):
            kr = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            s = torch.matmul(q.float(), kr.float().transpose(2, 3)) * q.shape[-1] ** -0.5
            seen.append(s[(bias == 0).expand_as(s)].abs())
            return inner(q, k, v, bias, *rest, **kw)

        attn._attend_full = spy

    for attn in layers:
        wrap(attn)
    try:
        with torch.no_grad():
            backend.logprobs(batch)
    finally:
        for attn in layers:
            del attn._attend_full  # the instance attribute goes; the class method is back
    s = torch.cat(seen)
    return {"attn_logit_abs_mean": float(s.double().mean()), "attn_logit_abs_p99": percentiles(s, [99.0])[0],
            "attn_logit_abs_max": float(s.max())}


def run_policy(name: str, base: list[str], model_dir: str, batch, timed, reps: int):
    """(log-probs of the scored tokens, entropy or None, ms per step, backend) under ``name``."""
    backend = TorchBackend(bench_config([*base, *policy_overrides(name)]), model_dir)
    with torch.no_grad():
        logp, ent = backend.logprobs(batch, with_entropy=name == "fp32")
    return logp, ent, time_steps(backend, timed, reps), backend


def score_all(base: list[str], model_dir: str, groups: list, args) -> tuple[dict, dict]:
    """Every policy's metrics, and context measured on the way (entropy, attention logits)."""
    batch = collate(groups, learner_version=0)
    timed = collate(groups[: args.time_groups], learner_version=0)
    out, ref, ctx = {}, None, {"tokens_scored": batch.num_tokens, "timed_tokens": timed.num_tokens}
    for name in POLICIES:
        t0 = time.perf_counter()
        logp, ent, ms, backend = run_policy(name, base, model_dir, batch, timed, args.time_reps)
        if ref is None:
            ref = logp
            ctx["mean_entropy"] = float(ent.double().mean())  # ent: the completion tokens only
            ctx.update(attention_logit_scale(backend, timed))
        out[name] = {**compare(logp, ref, batch.behaviour_logp, batch.mask), "ms_per_step": ms}
        print(f"  {name:<13} scored and timed in {time.perf_counter() - t0:.1f} s", flush=True)
    return out, ctx


# ---- context and report ---------------------------------------------------------------------------


def cpu_flags() -> dict[str, bool]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return {flag: flag in flags for flag in CPU_FLAGS}


def model_info(model_dir: str) -> dict:
    c = read_config(model_dir)
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
    return {k: c.get(k) for k in keys}


def _cell(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


TABLE = (("ratio mean", "ratio_mean"), ("p50", "ratio_p50"), ("p99", "ratio_p99"), ("p99.9", "ratio_p999"),
         ("min", "ratio_min"), ("max", "ratio_max"), ("k3", "kl_k3"), ("|dlogp| mean", "abs_logp_diff_mean"),
         ("|dlogp| p99", "abs_logp_diff_p99"), ("vs fp32 p99", "vs_fp32_abs_logp_p99"), ("ms/step", "ms_per_step"))


def report(res: dict) -> None:
    m = res["model"]
    print(f"\nprecision ablation: {m['model_type']} vocab {m['vocab_size']}, hidden {m['hidden_size']}, "
          f"{m['num_hidden_layers']} layers, {m['num_attention_heads']}/{m['num_key_value_heads']} heads; "
          f"{res['prompts']} prompts x {res['group_size']} = {res['tokens_scored']} tokens "
          f"({res['response_len']} each), sampled by the engine in {res['actor_dtype']}")
    print(f"sampled positions: mean entropy {res['mean_entropy']:.2f} nats (log V = {math.log(m['vocab_size']):.2f}); "
          f"attention logits |q.k|/sqrt(d): mean {res['attn_logit_abs_mean']:.1f}, "
          f"p99 {res['attn_logit_abs_p99']:.1f}, max {res['attn_logit_abs_max']:.1f}")
    rows = [[name, *(_cell(p[key]) for _, key in TABLE)] for name, p in res["policies"].items()]
    print(format_table(["policy", *(h for h, _ in TABLE)], rows))
    print(f"ms/step: forward_backward + discard_grads, median of {res['time_reps']}, on {res['timed_tokens']} "
          f"tokens ({res['time_groups']} group(s)); {res['threads']} thread(s); cpu flags "
          f"{[k for k, v in res['cpu_flags'].items() if v]}; load average {res['load_avg'][0]:.2f} -> "
          f"{res['load_avg'][1]:.2f}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an HF-format checkpoint to use instead of building one (init flags ignored)")
    ap.add_argument("--actor-dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (actor.group_size, >= 2)")
    ap.add_argument("--response-len", type=int, default=128, help="tokens in every completion")
    for flag, default in (("vocab", 32768), ("hidden", 256), ("layers", 4), ("heads", 4), ("kv-heads", 2),
                          ("head-dim", 64), ("intermediate", 768)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--embed-std", type=float, default=1.0)
    ap.add_argument("--qk-gain", type=float, default=3.5, help="q/k init gain: score std ~ qk_gain^2")
    ap.add_argument("--out-gain", type=float, default=0.3, help="o/down projection init gain: each layer's share")
    ap.add_argument("--head-gain", type=float, default=4.5, help="LM head init gain: the logits' std")
    ap.add_argument("--time-groups", type=int, default=1, help="groups in the timed forward_backward batch")
    ap.add_argument("--time-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="config overrides (section.key=value) for actor and learner")
    args = ap.parse_args(argv)
    for name in ("prompts", "group", "response_len", "time_groups", "time_reps", "threads"):
        if getattr(args, name) < (2 if name == "group" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'group' else 1}, got {getattr(args, name)}")
    if args.time_groups > args.prompts:
        ap.error(f"--time-groups={args.time_groups} exceeds --prompts={args.prompts}")
    return args


def run(args, model_dir: str) -> dict:
    info = model_info(model_dir)
    base = [f"model.path={json.dumps(model_dir)}", f"model.vocab_size={info['vocab_size']}",
            f'actor.dtype="{args.actor_dtype}"', f"actor.max_new_tokens={args.response_len}",
            f"actor.group_size={args.group}", f"actor.max_batch={args.prompts * args.group}",
            f"learner.groups_per_step={args.prompts}", f"run.seed={args.seed}", *args.overrides]
    cfg = bench_config(base)
    groups, gen_s = sample_groups(cfg, model_dir, make_prompts(args.prompts, info["vocab_size"], args.seed))
    print(f"sampled {args.prompts} x {args.group} completions of {args.response_len} tokens in {gen_s:.1f} s "
          f"({args.actor_dtype})", flush=True)
    policies, ctx = score_all(base, model_dir, groups, args)
    return {"policies": policies, **ctx, "model": info, "prompts": args.prompts, "group_size": args.group,
            "response_len": args.response_len, "actor_dtype": args.actor_dtype,
            "actor_fp32_attn_softmax": cfg.actor.fp32_attn_softmax, "generate_s": gen_s,
            "time_groups": args.time_groups, "time_reps": args.time_reps}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load, t0 = load_avg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="driftrl-bench-precision-") as tmp:
        model_dir = args.model or os.path.join(tmp, "model")
        if not args.model:
            build_checkpoint(model_dir, args)
        res = run(args, model_dir)
    res.update(threads=args.threads, cpu_flags=cpu_flags(), torch=torch.__version__, seed=args.seed,
               load_avg=[round(load[0], 2), round(load_avg()[0], 2)], wall_s=time.perf_counter() - t0,
               init=None if args.model else {"embed_std": args.embed_std, "qk_gain": args.qk_gain,
                                             "out_gain": args.out_gain, "head_gain": args.head_gain})
    report(res)
    print(json.dumps(json_safe({"bench": "precision", **res})))


if __name__ == "__main__":
    main()
