"""driftrl: asynchronous off-policy RL for LLM post-training, one command: ``driftrl`` once
installed (``pip install -e .``), or ``python run.py`` from a checkout; the same subcommands.

    python run.py [train] [--config FILE.toml] [section.key=value ...]  train (defaults: tiny CPU run)
    python run.py resume RUN_DIR [section.key=value ...]          continue a stopped run
    python run.py eval CKPT [TASK ...] [section.key=value ...] [--k K] [--tiers]
                                                                  pass@1/pass@k, lengths (JSON); --tiers:
                                                                  the Low/Medium/High table
    python run.py sweep KEY=V1,V2,... [KEY=VALUE ...] [--seeds N] [--minutes M] [--resume OUT]
                                                                  short trainings, one table (sweep.py)
    python run.py tail [RUN_DIR] [--last N] [--json]              the tokens of the ratio tail
    python run.py pipeline [--config FILE] [--resume DIR]          RL -> distillation -> RL -> tiered RL (pipeline.py)
    python run.py monitor [RUN_DIR] [--follow] [--speed X]        attach the live view to a job (or replay one)
    python run.py plot [RUN_DIR]                                  PNG figures into RUN_DIR/plots/

jobs.py (below run.py, pipeline.py and sweep.py) wires the job; dataflow, who waits for whom: ARCHITECTURE.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

import msgspec

from core import config as C
from core import launchers
from jobs import check_seams, first_eval, funnel_of, learner_memory, load_config, resolve_checkpoint, train
from learner import checkpoint

# `driftrl` (the installed command) or `run.py`: usage lines name what the user typed
PROG = "driftrl" if os.path.basename(sys.argv[0]) == "driftrl" else "run.py"
# subcommands that only read a run's files (no torch import; monitor never signals the job; plot: matplotlib)
READERS = {"tail": "learner.tailview", "monitor": "core.attach", "plot": "core.plots"}


def parse(argv):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML file with overrides of the defaults")
    ap.add_argument("--k", type=int, default=4, help="eval: samples per prompt for pass@k")
    ap.add_argument("--tiers", action="store_true",
                    help="eval: per tier, accuracy and mean response tokens under its prompt and length limit")
    ap.add_argument("args", nargs="*", help="`train`, `resume RUN_DIR`, `eval CKPT [TASK ...]`; section.key=value")
    ns = ap.parse_intermixed_args(argv)
    rest = ns.args[1:] if ns.args[:1] == ["train"] else ns.args  # `driftrl train ...` = `driftrl ...`
    ns.mode, ns.target, ns.overrides = "train", None, rest
    if rest[:1] in (["resume"], ["eval"]):
        if len(rest) < 2:
            ap.error(f"{rest[0]} needs a {'RUN_DIR' if rest[0] == 'resume' else 'CKPT'}")
        ns.mode, ns.target, ns.overrides = rest[0], os.path.abspath(rest[1]), rest[2:]
    if ns.k < 1:
        ap.error("--k must be >= 1")
    if ns.tiers and ns.mode != "eval":
        ap.error("--tiers is an eval option: run.py eval CKPT --tiers")
    return ns


def eval_main(args) -> int:
    """A report per task (actor/evaluate.py), or with ``--tiers`` the Low / Medium / High table of
    one task under the run's (or the given) tier prompts and limits; the JSON is the last line."""
    import torch

    from actor.evaluate import task_report
    from core.progress import progress
    from pipeline import TIERS, evaluate_model

    model_dir, run_cfg = resolve_checkpoint(args.target)
    checkpoint.verify_model(model_dir)
    tasks = [a for a in args.overrides if "=" not in a]
    overrides = [a for a in args.overrides if "=" in a]
    if args.tiers and len(tasks) > 1:
        raise C.ConfigError("--tiers evaluates one task: give at most one TASK")
    base = load_config(args.config, os.path.dirname(run_cfg), overrides) if run_cfg else C.load(args.config, overrides)
    base = msgspec.structs.replace(base, model=msgspec.structs.replace(base.model, path=model_dir))
    torch.set_num_threads(base.actor.threads)
    report = {"checkpoint": model_dir, "tasks": {}}
    for name in tasks or [base.task.name]:
        cfg = msgspec.structs.replace(base, task=msgspec.structs.replace(base.task, name=name))
        check_seams(cfg)
        if not args.tiers:
            report["tasks"][name] = task_report(cfg, model_dir, args.k, progress)
            continue
        report = {**evaluate_model(cfg, model_dir, args.k, by="tier"), "checkpoint": model_dir, "task": name}
        for t, row in ((t, report["tiers"][t]) for t in TIERS if report["tiers"].get(t)):
            print(f"{t:<7} accuracy {row['accuracy']:.3f}  mean response tokens {row['mean_length']:.2f}  "
                  f"({row['prompts']} prompts)")
    print(json.dumps(report))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in READERS:
        return importlib.import_module(READERS[argv[0]]).main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s")
    launchers.Interrupt.install()  # SIGTERM (e.g. from a job scheduler) stops the run like Ctrl-C
    if argv[:1] in (["sweep"], ["pipeline"]):  # their own options (--seeds, --resume, ...): sweep.py, pipeline.py
        return failure_exit(lambda: importlib.import_module(argv[0]).main(argv[1:]))
    args = parse(argv)
    return failure_exit(lambda: eval_main(args) if args.mode == "eval" else train_main(args))


def cli() -> int:
    """The command line (``python run.py``, ``driftrl``). Once main has decided the exit code, a late
    SIGTERM is recorded, never raised into the interpreter's teardown (a finalizer would print it)."""
    try:
        return main()
    finally:
        launchers.Interrupt.deferred = True


def failure_exit(work) -> int:
    """``work()``'s exit code; a config error exits 2, a failed role or contract check its own."""
    from learner.contract import ContractError

    try:
        return work()
    except (C.ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except checkpoint.DamagedCheckpoint as e:
        print(f"damaged: {e}", file=sys.stderr)
        return 65
    except (launchers.RoleFailed, ContractError) as e:
        print(f"run failed: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)


def train_main(args) -> int:
    from actor.evaluate import final_eval

    resume_dir = args.target if args.mode == "resume" else None
    try:
        result = train(load_config(args.config, resume_dir, args.overrides), resume_dir)
    except BaseException:  # a signal in the model build or contract check, as whatever a C extension made of it
        if not launchers.Interrupt.signalled:
            raise
        print("interrupted; nothing left running")
        return 130
    if result.interrupted:
        print(f"interrupted; all roles stopped. Resume with: python run.py resume {result.run_dir}")
        return 130
    final = final_eval(result.run_dir)
    start = first_eval(result.run_dir)
    print(f"done in {result.wall_s:.0f}s: held-out reward {start if start is not None else float('nan'):.3f} "
          f"-> {final['eval/reward']:.3f}; run dir {result.run_dir}")
    books = funnel_of(result.run_dir)
    print("\n".join(line for line in (books.line() and f"funnel: {books.line()}", books.length_line()) if line))
    if (mem := learner_memory(result.run_dir)) and mem["state_mb"]:
        print(f"learner memory: peak {mem['peak_rss_mb']:,.0f} MB resident ({mem['shm_mb'] or 0:,.0f} MB of it mapped "
              f"shared) = {mem['peak_rss_mb'] / mem['state_mb']:.2f}x its weights + gradients + AdamW state "
              f"({mem['state_mb']:,.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
