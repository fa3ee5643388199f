"""Bench: driftrl vs TRL's GRPOTrainer, same base model, task, batch, optimiser, precision and CPU budget.

Both sides train one model on one task with one recipe, one after the other on the same machine,
each for ``--seconds`` of training wall time. By default that is the built-in job (the cached tiny
base model on ArithTask); ``--config configs/smollm2.toml`` (a real pretrained model on math-verify
scored sums), ``--model PATH`` and ``--task NAME`` pick another recipe, the same for both sides:

    | setting               | driftrl                                 | TRL GRPOTrainer                          |
    |-----------------------|-----------------------------------------|-------------------------------------------|
    | prompts x completions | groups_per_step x group_size per step   | per_device_train_batch_size, G=group_size |
    | sampling              | the config's temperature/top-k/top-p and max_new_tokens, the model's EOS          |
    | optimiser             | AdamW, the config's lr/betas/clip       | adamw_torch, same, constant schedule     |
    | loss                  | Ring-Zero, token-level constant divisor | dr_grpo (constant divisor), beta=0       |
    | advantages            | group mean / std                        | scale_rewards="group"                    |
    | CPU threads (2 cores) | 1 actor + 1 learner process, 1 each     | one process, 1 or 2 torch threads (*)    |
    | precision (--precision, default auto: BF16 where this CPU computes it natively, else FP32)        |
    |                       | learner.body_dtype and actor.dtype      | bf16=True/False (autocast), FP32 weights |

(*) ``--trl-threads auto`` (default) probes 1 and 2 threads for ``--probe-s`` each and gives TRL
the faster: on the tiny model two OpenMP threads can lose to one, badly so on a loaded machine.

TRL's dataset holds train-split prompts as the text of driftrl's prompt ids (chat template and
special tokens written out); the bench asserts that TRL's tokenizer encodes them to exactly those
ids, and the reward function calls the task's own ``rewards`` (its math-verify pool, for pooled
tasks) on TRL's completion token ids (EOS included), so both sides optimise the identical reward.

Held-out evaluation is identical and off the clock for both: the weights are snapshotted every
``--eval-every-s`` seconds of training wall time (driftrl: read from the weight transport by a
second reader; TRL: a TrainerCallback copying the state dict), and right after each run every
snapshot is scored by the same ``bench.common.HeldOutEval`` (driftrl's own ``evaluate``, same
prompts, same seed). Time axes start at each trainer's first step (driftrl: the learner's first
publish; TRL: ``on_train_begin``), so process start-up is left out of both.

Figures: time to reach the held-out reward threshold (``--threshold``, default base + 0.3), the
time driftrl takes to reach TRL's final held-out reward against TRL's own (``time_to_trl_final_ratio``),
samples/s (completions trained on / training wall), final held-out reward after the equal wall
time, and where each side's time went. Needs ``pip install trl``; exits 2 with a message if not.

    python bench/vs_trl.py [--seconds 200] [--eval-every-s 2.5] [--threshold 0.5] [--trl-threads auto]
    python bench/vs_trl.py --config configs/smollm2.toml --seconds 600 --eval-every-s 60 \
        --eval-prompts 128 --eval-threads 2 --trl-threads 2

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    CpuMeter, HeldOutEval, format_table, json_safe, load_avg, ratio, resolved_config, reward_at,
    run_driftrl, summarize_run, time_to_threshold, version_times,
)
from core.proc import learner_state_mb  # noqa: E402

TRL_THREADS = 2  # default: the same two cores driftrl's actor and learner get, one thread each


def trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


# ---- TRL side -------------------------------------------------------------------------------------


def train_prompts(task, n: int, seed: int):
    """``n`` train-split prompts as a datasets.Dataset: prompt text, driftrl's ids, the answer."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [task.sample(rng, "train") for _ in range(n)]
    return Dataset.from_dict({"prompt": [prompt_text(task, p) for p in prompts],
                              "ids": [list(p.tokens) for p in prompts], "answer": [p.answer for p in prompts]})


def prompt_text(task, prompt) -> str:
    """The prompt's text with its special tokens written out, as TRL's tokenizer reads it."""
    return task.tok.tok.decode(list(prompt.tokens), skip_special_tokens=False)


def check_prompt_ids(tokenizer, prompts: list[str], ids: list[list[int]]) -> None:
    """TRL tokenises prompts with ``processing_class(text=prompts)``: it must give our ids."""
    got = tokenizer(text=list(prompts))["input_ids"]
    bad = [i for i, (g, w) in enumerate(zip(got, ids)) if g != w]
    if bad or len(got) != len(ids):
        i = bad[0] if bad else 0
        raise AssertionError(f"TRL's tokenizer encodes {prompts[i]!r} as {got[i]}, driftrl as {ids[i]}")


def make_reward(task):
    """TRL's reward function: the task's own rewards (its reward pool, for pooled tasks) on TRL's
    completion token ids, EOS included, as driftrl's actors score them."""
    from actor.tasks import Prompt

    def task_reward(prompts, completions, completion_ids, ids, answer, **_):
        return task.rewards([(Prompt("", tuple(p), answer=a), list(c)) for c, p, a in zip(completion_ids, ids, answer)])

    return task_reward


def trl_args(cfg, out_dir: str, seconds: float):
    from trl import GRPOConfig

    a, lc = cfg.actor, cfg.learner
    bf16 = lc.body_dtype == "bfloat16"  # driftrl's precision (resolved by main): FP32 master weights either way
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=bf16, fp16=False, seed=cfg.run.seed,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=lc.groups_per_step * a.group_size,  # completions per step
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens,
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, beta=0.0, use_vllm=False,
        loss_type="dr_grpo", scale_rewards="group", mask_truncated_completions=False,
        learning_rate=lc.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=lc.betas[0], adam_beta2=lc.betas[1], weight_decay=lc.weight_decay,
        max_grad_norm=lc.grad_clip, gradient_checkpointing=False,
        max_steps=1_000_000,  # the wall-time budget stops the run (BudgetCallback)
        logging_steps=100, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_pin_memory=False, remove_unused_columns=False,
    )


def budget_callback(seconds: float, every_s: float):
    from transformers import TrainerCallback

    class BudgetCallback(TrainerCallback):
        """Wall-time budget plus weight snapshots on the same grid as driftrl's observer."""

        def __init__(self):
            self.t0, self.next_t, self.last_t = None, every_s, 0.0
            self.snapshots: list[tuple[float, dict]] = []  # (train seconds, state dict)

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.last_t = time.time() - self.t0
            if self.last_t >= self.next_t or self.last_t >= seconds:
                self.snapshots.append((self.last_t, {k: v.detach().clone() for k, v in model.state_dict().items()}))
                while self.next_t <= self.last_t:
                    self.next_t += every_s
            if self.last_t >= seconds:
                control.should_training_stop = True

    return BudgetCallback()


def run_trl(cfg, seconds: float, every_s: float, out_dir: str, threads: int = TRL_THREADS) -> dict:
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from bench.common import make_task

    torch.set_num_threads(threads)
    task = make_task(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    dataset = train_prompts(task, 200_000, cfg.run.seed)
    head = dataset.select(range(256))
    check_prompt_ids(tokenizer, head["prompt"], head["ids"])
    cb = budget_callback(seconds, every_s)
    t_setup = time.time()
    trainer = GRPOTrainer(model=cfg.model.path, reward_funcs=make_reward(task), args=trl_args(cfg, out_dir, seconds),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[cb])
    gen = {"s": 0.0, "n": 0}
    inner = trainer._generate_and_score_completions

    def timed_generate(*args, **kw):  # generation + reward + advantages: TRL's rollout phase
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            gen["s"] += time.perf_counter() - t0
            gen["n"] += 1

    trainer._generate_and_score_completions = timed_generate
    setup_s = time.time() - t_setup
    try:
        trainer.train()
    finally:
        task.close()
    steps = trainer.state.global_step
    per_step = cfg.learner.groups_per_step * cfg.actor.group_size
    return {"steps": steps, "samples": steps * per_step, "train_wall_s": cb.last_t,
            "samples_per_s": steps * per_step / cb.last_t if cb.last_t else None,
            "step_s_mean": cb.last_t / steps if steps else None, "rollout_s": gen["s"],
            "train_compute_s": cb.last_t - gen["s"], "setup_s": setup_s, "threads": threads,
            "snapshots": cb.snapshots}


def pick_trl_threads(cfg, choice: str, probe_s: float, out_dir: str) -> tuple[int, dict]:
    """TRL is one process: within the two-core budget give it whichever thread count runs faster
    right now (on a tiny model, two OpenMP threads can lose to one, more so on a loaded machine)."""
    if choice != "auto":
        return int(choice), {}
    probe = {}
    for n in (1, 2):
        r = run_trl(cfg, probe_s, probe_s * 10, os.path.join(out_dir, f"trl-probe{n}"), n)
        probe[n] = r["samples_per_s"] or 0.0
    best = max(probe, key=probe.get)
    print(f"TRL thread probe ({probe_s:.0f}s each): " + ", ".join(f"{n} thread(s) {v:.0f} samples/s"
                                                            for n, v in probe.items()) + f" -> {best}", flush=True)
    return best, probe


# ---- driftrl side ---------------------------------------------------------------------------------


def run_drift(cfg, every_s: float, out_dir: str) -> dict:
    result, records, snaps = run_driftrl(cfg, os.path.join(out_dir, "driftrl"), snapshot_every_s=every_s)
    s = summarize_run(records, cfg.learner.groups_per_step, cfg.actor.group_size)
    times = version_times(records)
    # a snapshot's time is when its version was published (the learner's own clock)
    s["snapshots"] = [(times[v], state) for v, state in snaps if v in times]
    # the final weights close the curve at the end of the budget, as TRL's last step does
    from safetensors.torch import load_file

    final = load_file(os.path.join(result.run_dir, "final_model", "model.safetensors"))
    s["snapshots"].append((s["train_wall_s"], final))
    s["total_wall_s"] = result.wall_s
    return s


# ---- comparison -----------------------------------------------------------------------------------


def score_curve(side: dict, evaluate, base_reward: float) -> None:
    """Held-out reward of each snapshot, off the clock, right after the side's run (its snapshots,
    a model's worth of memory each, are then freed)."""
    t0, snapshots = time.time(), side.pop("snapshots")
    side["curve"] = [(0.0, base_reward)]
    while snapshots:
        t, state = snapshots.pop(0)
        side["curve"].append((t, evaluate(state)[0]))
    side["eval_s"] = time.time() - t0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a driftrl config file as the shared recipe "
                    "(e.g. configs/smollm2.toml); default: the built-in job")
    ap.add_argument("--model", default=None, help="an HF model directory for both sides (model.path)")
    ap.add_argument("--task", default=None, help="the task of both sides (task.name; its keys via -o task.KEY=V)")
    ap.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="both sides' body precision; auto = what driftrl picks on this CPU")
    ap.add_argument("--seconds", type=float, default=200.0, help="training wall-time budget of each system")
    ap.add_argument("--eval-every-s", type=float, default=2.5, help="snapshot grid (training seconds)")
    ap.add_argument("--eval-prompts", type=int, default=512)
    ap.add_argument("--eval-threads", type=int, default=1, help="torch threads of the (off-clock) evaluation")
    ap.add_argument("--threshold", type=float, default=None, help="held-out reward to reach (default: base + 0.3)")
    ap.add_argument("-o", "--override", action="append", default=[],
                    help="section.key=value for the shared recipe (both sides) (repeatable)")
    ap.add_argument("--drift-override", action="append", default=[], help="section.key=value for driftrl only")
    ap.add_argument("--trl-threads", default="auto",
                    help="torch threads for TRL: a number, or `auto` = the faster of 1 and 2 in a short probe")
    ap.add_argument("--probe-s", type=float, default=12.0, help="length of each `auto` thread probe")
    ap.add_argument("--out", default="", help="directory for both runs (default: a temp dir)")
    return ap.parse_args(argv)


def shared_overrides(args) -> list[str]:
    """The recipe both sides share: the budget, model, task and one precision for both."""
    from core.precision import choose

    dtype = choose(args.precision, "cpu")[0]
    picked = [f"model.path={args.model}"] * bool(args.model) + [f"task.name={args.task}"] * bool(args.task)
    return [f"run.max_time_s={args.seconds}", "run.max_steps=0", "run.eval_every=0",
            f"run.eval_prompts={args.eval_prompts}", *picked, f"learner.body_dtype={dtype}", f"actor.dtype={dtype}",
            *args.override]


def cell_mb(mb: float | None) -> str:
    return "–" if mb is None else f"{mb:,.0f} MB"


def cell_s(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.0f} s"


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = trl_missing()
    if missing:
        print(f"TRL is not installed ({missing}); install it with `pip install trl` "
              "(check that it keeps torch==2.13.0) to run this bench.", file=sys.stderr)
        return 2
    out_dir = args.out or tempfile.mkdtemp(prefix="bench-vs-trl-")
    shared = shared_overrides(args)
    cfg = resolved_config(shared, args.config)
    drift_cfg = resolved_config([*shared, *args.drift_override], args.config)
    evaluate = HeldOutEval(cfg, args.eval_prompts, args.eval_threads)
    base = evaluate(evaluate.model.state_dict())[0]
    threshold = args.threshold if args.threshold is not None else round(base + 0.3, 3)
    print(f"base model {cfg.model.path}, task {cfg.task.name}, body {cfg.learner.body_dtype}: held-out reward "
          f"{base:.3f}; threshold {threshold:.3f}; {args.seconds:.0f}s each; out {out_dir}", flush=True)

    load = {"load1_start": load_avg()[0]}
    with CpuMeter() as cpu:
        drift = run_drift(drift_cfg, args.eval_every_s, out_dir)
    load["driftrl_foreign_cores"] = cpu.result["foreign_cores"]
    score_curve(drift, evaluate, base)
    threads, probe = pick_trl_threads(cfg, args.trl_threads, args.probe_s, out_dir)
    with CpuMeter() as cpu:
        trl = run_trl(cfg, args.seconds, args.eval_every_s, os.path.join(out_dir, "trl"), threads)
    load["trl_foreign_cores"] = cpu.result["foreign_cores"]
    score_curve(trl, evaluate, base)

    sides = {"driftrl": drift, "trl": trl}
    for s in sides.values():
        s["time_to_threshold_s"] = time_to_threshold(s["curve"], threshold)
        s["final_reward"] = reward_at(s["curve"], args.seconds + 1e9)
        s["reward_at_equal_time"] = reward_at(s["curve"], min(drift["train_wall_s"], trl["train_wall_s"]))
        # one eval is +-0.02 noise (512 prompts): also the mean over the last tenth of the budget
        tail = [r for t, r in s["curve"] if t >= 0.9 * args.seconds]
        s["final_reward_last10pct"] = sum(tail) / len(tail) if tail else None
    print(f"evaluated {sum(len(s['curve']) for s in sides.values())} snapshots in "
          f"{sum(s['eval_s'] for s in sides.values()):.0f}s (off the clock)\n")

    print(format_table(
        ["system", "steps", "samples/s", "step ms", f"t->{threshold:.2f} s", "reward@equal t", "final reward",
         "mean last 10%"],
        [[n, s["steps"], s["samples_per_s"], 1e3 * s["step_s_mean"], s["time_to_threshold_s"],
          s["reward_at_equal_time"], s["final_reward"], s["final_reward_last10pct"]] for n, s in sides.items()]))
    levels = sorted({round(base + d, 3) for d in (0.1, 0.2, 0.3, 0.4, 0.5)} | {threshold})
    print("\ntraining seconds to reach a held-out reward (– = not within the budget):")
    print(format_table(["system", *(f">= {x:.2f}" for x in levels)],
                       [[n, *(time_to_threshold(s["curve"], x) for x in levels)] for n, s in sides.items()]))
    print("\nwhere the training wall time went (seconds):")
    print(format_table(["system", "wall", "generation", "training", "waiting", "weight sync"], [
        ["driftrl", drift["train_wall_s"], drift["actor_gen_s"], drift["learner_compute_s"],
         drift["learner_wait_s"], drift["weightsync_publish_s"] + drift["weightsync_apply_s_est"]],
        ["trl", trl["train_wall_s"], trl["rollout_s"], trl["train_compute_s"], 0.0, 0.0]]))
    print("  (driftrl: generation and training overlap on separate cores; TRL alternates them in one process)")
    print("\nheld-out reward curve (train seconds: reward):")
    for n, s in sides.items():
        print(f"  {n:8s}" + " ".join(f"{t:.0f}:{r:.2f}" for t, r in s["curve"]))
    print("other work on the machine (cores, from /proc/stat minus this bench's own processes): "
          f"driftrl run {load['driftrl_foreign_cores']:.2f}, TRL run {load['trl_foreign_cores']:.2f}")

    # issue-style figure: how long driftrl takes to reach what TRL ends its budget with
    trl_final = trl["final_reward"]
    to_trl_final = {n: time_to_threshold(s["curve"], trl_final) for n, s in sides.items()}
    print(f"\ntime to TRL's final held-out reward {trl_final:.3f}: driftrl {cell_s(to_trl_final['driftrl'])}, "
          f"TRL {cell_s(to_trl_final['trl'])}")
    state_mb = learner_state_mb(sum(p.numel() for p in evaluate.model.parameters()))
    peak = drift["learner_peak_rss_mb"]
    print(f"driftrl learner's peak resident memory: {cell_mb(peak)} ({cell_mb(drift['learner_shm_mb'])} of it mapped "
          f"shared memory) = {ratio(peak, state_mb) or float('nan'):.2f}x its state ({state_mb:.0f} MB)")
    figures = {
        "bench": "vs_trl",
        "time_to_trl_final_ratio": ratio(to_trl_final["driftrl"], to_trl_final["trl"]),
        "time_to_trl_final_s": to_trl_final,
        "time_to_reward_ratio": ratio(drift["time_to_threshold_s"], trl["time_to_threshold_s"]),
        "samples_per_s_ratio": ratio(drift["samples_per_s"], trl["samples_per_s"]),
        "final_reward_driftrl": drift["final_reward"], "final_reward_trl": trl["final_reward"],
        "final_reward_last10pct_driftrl": drift["final_reward_last10pct"],
        "final_reward_last10pct_trl": trl["final_reward_last10pct"],
        "base_reward": base, "threshold": threshold, "seconds": args.seconds,
        "time_to_threshold_driftrl_s": drift["time_to_threshold_s"],
        "time_to_threshold_trl_s": trl["time_to_threshold_s"],
        "samples_per_s_driftrl": drift["samples_per_s"], "samples_per_s_trl": trl["samples_per_s"],
        "learner_peak_over_state": ratio(peak, state_mb), "learner_peak_rss_mb": peak,
        "learner_shm_mb": drift["learner_shm_mb"], "learner_state_mb": state_mb,
        "load": load, "trl_threads": threads, "trl_thread_probe_samples_per_s": probe,
        "drift_overrides": args.drift_override, "config": args.config, "model": cfg.model.path,
        "task": cfg.task.name, "precision": cfg.learner.body_dtype,
        "runs": sides,
    }
    print(json.dumps(json_safe(figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
