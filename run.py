"""driftrl: asynchronous off-policy RL for LLM post-training, one command.

    python run.py [--config FILE.toml] [section.key=value ...]    train (defaults: tiny CPU run)
    python run.py resume RUN_DIR [section.key=value ...]          continue a stopped run

Dataflow (DESIGN.md §1)::

    tasks ──prompts──▶ actor ×N ──RolloutGroup (ZMQ, msgspec)──▶ buffer ──SampleBatch──▶ learner
                        ▲  behaviour log-probs + per-token versions        (staleness,     │
                        │                                                    persistence)  │
                        └───────── weightsync (shared memory) ◀── publish(version) ────────┘
    every role ──MetricRecords──▶ launcher: rich view + run_dir/metrics.jsonl

    On one host (``buffer.by_ref``) the group bytes go through run_dir, not the sockets: the
    actor stages a group in its slot (buffer/staging/) and sends a GroupRef; the buffer
    validates it and copies it into its segment log; the SampleBatch carries StoredRefs the
    learner reads from that log.

Who waits for whom:

    | role     | waits for                                 | unblocked by                          |
    |----------|-------------------------------------------|---------------------------------------|
    | actor    | first weights (version 0)                 | learner's first publish               |
    | actor    | admission: started <= (S+v+1)*share       | learner publishing version v+1        |
    | actor    | buffer ack window / "busy" (buffer full)  | learner consuming groups              |
    | learner  | groups_per_step fresh groups              | actors' RolloutGroups reaching buffer |
    | buffer   | nothing: serves both sides from one loop  |                                       |
    | launcher | learner exit (step/time budget reached)   | learner finishing its budget          |
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from core import config as C
from core import launch


def parse(argv):
    ap = argparse.ArgumentParser(prog="run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML file with overrides of the defaults")
    ap.add_argument("args", nargs="*", help="`resume RUN_DIR` and/or section.key=value overrides")
    ns = ap.parse_args(argv)
    resume_dir = None
    rest = list(ns.args)
    if rest and rest[0] == "resume":
        if len(rest) < 2:
            ap.error("resume needs a RUN_DIR")
        resume_dir, rest = os.path.abspath(rest[1]), rest[2:]
    return ns.config, resume_dir, rest


def load_config(toml_path, resume_dir, overrides) -> C.Config:
    if resume_dir is None:
        return C.load(toml_path, overrides)
    path = os.path.join(resume_dir, "config.json")
    if not os.path.exists(path):
        raise C.ConfigError(f"{resume_dir} has no config.json: not a driftrl run directory")
    with open(path, "rb") as f:
        tree = json.loads(f.read())
    # fresh ports: the old ones may be taken by now
    tree["net"].update(buffer_actor_port=0, buffer_learner_port=0, metrics_port=0)
    for item in overrides:
        C.apply_override(tree, item)
    return C.from_dict(tree)


def final_eval(cfg: C.Config, run_dir: str) -> dict:
    """Held-out reward of the final checkpoint, appended to metrics.jsonl."""
    import torch

    from actor.engine import TorchEngine
    from actor.tasks import EOS, PAD, make_task
    from actor.worker import evaluate
    from learner.model import load_pretrained

    torch.set_num_threads(1)
    task = make_task(cfg.task)
    a = cfg.actor
    engine = TorchEngine(load_pretrained(os.path.join(run_dir, "final_model")), temperature=a.temperature,
                         top_k=a.top_k, top_p=a.top_p, max_new_tokens=a.max_new_tokens, eos_id=EOS, pad_id=PAD,
                         seed=cfg.run.seed)
    reward, length = evaluate(engine, task, task.eval_set(cfg.run.eval_prompts))
    rec = {"step": -1, "time": time.time(), "role": "launcher", "id": "final_eval",
           "eval/reward": reward, "eval/length": length, "eval/final": 1.0}
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def first_eval(run_dir: str) -> float | None:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("eval/reward") is not None and not rec.get("eval/final"):
                return rec["eval/reward"]
    return None


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s")
    toml_path, resume_dir, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(toml_path, resume_dir, overrides)
    except C.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    # SIGTERM (e.g. from a job scheduler) stops the run exactly like Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        result = launch.run(cfg, resume_dir)
    except launch.RoleFailed as e:
        print(f"run failed: {e}", file=sys.stderr)
        return 1
    if result.interrupted:
        print(f"interrupted; all roles stopped. Resume with: python run.py resume {result.run_dir}")
        return 130
    with open(os.path.join(result.run_dir, "config.json"), "rb") as f:
        cfg = C.from_json(f.read())
    final = final_eval(cfg, result.run_dir)
    start = first_eval(result.run_dir)
    print(f"done in {result.wall_s:.0f}s: held-out reward {start if start is not None else float('nan'):.3f} "
          f"-> {final['eval/reward']:.3f}; run dir {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
