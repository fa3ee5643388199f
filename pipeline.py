"""``python run.py pipeline``: the Ring-Zero recipe as one resumable command.

Without ``--config`` the pipeline is configs/pipeline.toml (sized for 2 CPU cores); a file given
replaces it. Stages rl1 -> distill -> rl2 -> tiers, each from the model the one before wrote (their
configs, resume: ARCHITECTURE.md, "The staged recipe"). ``DIR/pipeline.json`` records what is done.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time

import msgspec

import jobs
from core import config as C
from core import launchers
from core.files import atomic_write, read_json
from core.progress import progress

log = logging.getLogger("driftrl.pipeline")
STAGES = ("rl1", "distill", "rl2", "tiers")
# the recipe's settings per RL stage; the user's [pipeline.<stage>] tables go on top
_SUSTAIN = {"learner": {"norm": "sample", "kl_beta": 0.0}, "actor": {"length_schedule": "off"}}
RECIPE = {"rl1": {"learner": {"norm": "token", "kl_beta": 0.01, "kl_estimator": "k3"},
                  "actor": {"length_schedule": "steps"}}, "rl2": _SUSTAIN, "tiers": _SUSTAIN}
TITLES = {"rl1": "1/4 rl1 · elicit", "distill": "2/4 distill", "rl2": "3/4 rl2 · sustain", "tiers": "4/4 tiers"}
TIERS = C.TIERS[1:]  # low, medium, high: the tiers a prompt is given ("default" is none)
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "pipeline.toml")


def stage_config(base: dict, stage: str, model_path: str, run_dir: str, extra: dict | None = None) -> C.Config:
    """``base`` + :data:`RECIPE` [stage] + ``[pipeline.<stage>]`` (+ ``extra``); the distillation
    samples with rl1's settings. rl1 must keep its KL, tiers must give every tier's prompt and limit."""
    tree = copy.deepcopy(base)
    rl = "rl1" if stage == "distill" else stage
    for top, where in ((RECIPE[rl], "$"), (base["pipeline"][rl], f"$.pipeline.{rl}"), (extra or {}, "$")):
        C.merge(tree, copy.deepcopy(top), where=where)
    tree["model"]["path"], tree["run"]["run_dir"], tree["run"]["stage"] = model_path, run_dir, TITLES[stage]
    cfg = C.from_dict(tree)
    if stage == "rl1" and cfg.learner.kl_beta <= 0:
        raise C.ConfigError("`$.pipeline.rl1.learner.kl_beta` must be > 0: stage 1 keeps a KL to the base model")
    missing = [f"task.{name}.{tier}" for name in ("system_prompt", "tier_max_new_tokens") for tier in TIERS
               if stage == "tiers" and tier not in getattr(cfg.task, name)]
    if missing:
        raise C.ConfigError(f"the tiers stage needs {', '.join(missing)} (`$.pipeline.tiers.task`)")
    return cfg


def all_configs(base: dict, out: str, evals: dict | None = None) -> dict[str, C.Config]:
    """Every stage's config (validated before the first starts), the tiers by rl2's pass rate once known."""
    inputs = {"rl1": base["model"]["path"], "distill": os.path.join(out, "rl1", "final_model"),
              "rl2": os.path.join(out, "distill", "model"), "tiers": os.path.join(out, "rl2", "final_model")}
    rl2 = (evals or {}).get("rl2") if base["pipeline"]["tier_by"] == "pass_rate" else None
    extra = {"tiers": {"task": {"difficulty_tiers": pass_rate_tiers(rl2["by_difficulty"])}}} if rl2 else {}
    return {s: stage_config(base, s, inputs[s], os.path.join(out, s), extra.get(s)) for s in STAGES}


def pass_rate_tiers(by_difficulty: dict[str, dict]) -> dict[str, str]:
    """``task.difficulty_tiers``: difficulties by held-out pass rate, highest first (ties: lower), in thirds."""
    ranked = sorted(by_difficulty, key=lambda d: (-by_difficulty[d]["accuracy"], float(d)))
    return {d: TIERS[min(2, 3 * i // len(ranked))] for i, d in enumerate(ranked)}


def save_state(out: str, state: dict) -> None:
    atomic_write(os.path.join(out, "pipeline.json"), json.dumps(state, indent=1).encode())


def pending(state: dict) -> list[str]:
    return [s for s in STAGES if state["stages"].get(s, {}).get("status") != "done"]


def run_rl(cfg: C.Config) -> dict:
    """One RL stage, an ordinary run in its own directory; one interrupted before resumes there."""
    run_dir = cfg.run.run_dir
    if os.path.exists(os.path.join(run_dir, "config.json")):
        log.info("resuming %s from its newest checkpoint", run_dir)
        cfg = jobs.load_config(None, run_dir, [])
    result = jobs.train(cfg, run_dir)
    if result.interrupted:  # what is done is kept, --resume continues
        raise KeyboardInterrupt
    return {"model": os.path.join(run_dir, "final_model"), "run_dir": run_dir}


def run_distill(cfg: C.Config, base_model: str) -> dict:
    """The rl1 policy writes the corpus, the *base* model is fine-tuned on it; each skipped once written."""
    from actor.distill import build_corpus
    from learner.sft import finetune

    out = cfg.run.run_dir
    os.makedirs(out, exist_ok=True)
    corpus, model = os.path.join(out, "corpus.jsonl"), os.path.join(out, "model")
    stats = read_json(os.path.join(out, "corpus.json"))
    if stats is None:
        with progress("distill: sampling", cfg.distill.prompts) as advance:
            stats = build_corpus(cfg, cfg.model.path, corpus, advance)
        atomic_write(os.path.join(out, "corpus.json"), json.dumps(stats, indent=1).encode())
    log.info("distillation corpus: %s", stats)
    sft = read_json(os.path.join(out, "sft.json"))
    if sft is None or not os.path.exists(os.path.join(model, "config.json")):
        sft = finetune(cfg, base_model, corpus, model, cfg.run.seed)
        atomic_write(os.path.join(out, "sft.json"), json.dumps(sft, indent=1).encode())
    return {"model": model, "run_dir": out, "corpus": stats, "sft": sft}


def evaluate_model(cfg: C.Config, model_dir: str, k: int, by: str = "difficulty") -> dict:
    """Held-out accuracy (pass@1 of ``k`` samples) and mean response tokens, overall and per difficulty or tier."""
    from actor.evaluate import task_report

    r = task_report(cfg, model_dir, k, progress)
    rows = {d: {"accuracy": v["pass@1"], "mean_length": v["mean_length"], "pass@k": v["pass@k"],
                "prompts": v["prompts"]} for d, v in r[f"by_{by}"].items()}
    return {"accuracy": r["pass@1"], "pass@k": r["pass@k"], "mean_length": r["mean_length"], "k": k,
            ("tiers" if by == "tier" else "by_difficulty"): rows}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="run.py pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help=f"TOML file with overrides of the defaults (default: {DEFAULT_CONFIG})")
    ap.add_argument("--out", help="the pipeline directory (default runs/pipeline-<UTC timestamp>)")
    ap.add_argument("--resume", metavar="DIR", help="continue the pipeline in DIR")
    ap.add_argument("--k", type=int, default=4, help="samples per held-out prompt in every evaluation")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides (not with --resume)")
    ns = ap.parse_args(argv)
    if ns.resume and (ns.config or ns.overrides or ns.out):
        ap.error("--resume DIR takes the pipeline's own config.json: no --config, --out or overrides")
    if ns.k < 1:
        ap.error("--k must be >= 1")
    return ns


def prepare(ns) -> tuple[str, dict]:
    """The pipeline directory and its base config tree (the model resolved), kept in ``DIR/config.json``."""
    if ns.resume:
        out = os.path.abspath(ns.resume)
        base = read_json(os.path.join(out, "config.json"))
        if base is None:
            raise FileNotFoundError(f"{out} has no config.json: not a pipeline directory")
        return out, base
    out = os.path.abspath(ns.out or launchers.new_run_dir(prefix="pipeline-"))
    cfg = C.load(ns.config or DEFAULT_CONFIG, ns.overrides)
    all_configs(msgspec.to_builtins(cfg), out)  # every stage's config valid before a model is built
    jobs.check_seams(cfg)
    cfg = jobs.resolve_model(cfg)
    os.makedirs(out, exist_ok=True)
    atomic_write(os.path.join(out, "config.json"), C.to_json(cfg))
    return out, msgspec.to_builtins(cfg)


def run_all(out: str, base: dict, k: int) -> dict:
    """Every pending stage, then the final tier table; the state is saved after each step."""
    state = read_json(os.path.join(out, "pipeline.json")) or {"stages": {}, "evals": {}}
    eval_cfg = C.from_dict(base)
    if "base" not in state["evals"]:
        state["evals"]["base"] = evaluate_model(eval_cfg, base["model"]["path"], k)
        save_state(out, state)
    for stage in pending(state):
        log.info("pipeline stage %s", TITLES[stage])
        cfg = all_configs(base, out, state["evals"])[stage]  # the tiers by rl2's pass rate once it is evaluated
        t0, before = time.time(), state["stages"].get(stage, {}).get("seconds", 0.0)
        state["stages"][stage] = {"status": "running", "seconds": before}
        save_state(out, state)
        try:
            info = run_distill(cfg, base["model"]["path"]) if stage == "distill" else run_rl(cfg)
        finally:  # an interrupted stage keeps the seconds it spent
            state["stages"][stage]["seconds"] = before + time.time() - t0
            save_state(out, state)
        state["evals"][stage] = evaluate_model(eval_cfg, info["model"], k)
        state["stages"][stage] = {"status": "done", **info, "seconds": before + time.time() - t0}
        save_state(out, state)
    tiers_cfg = all_configs(base, out, state["evals"])["tiers"]
    report = {**evaluate_model(tiers_cfg, state["stages"]["tiers"]["model"], k, by="tier"), "pipeline": out,
              "stages": state["evals"], "seconds": {s: round(state["stages"][s]["seconds"], 1) for s in STAGES}}
    atomic_write(os.path.join(out, "eval.json"), json.dumps(report, indent=1).encode())
    return report


def main(argv: list[str]) -> int:
    ns = parse(argv)
    out = None
    try:
        out, base = prepare(ns)
        report = run_all(out, base, ns.k)
    except KeyboardInterrupt:
        where = f"Resume with: python run.py pipeline --resume {out}" if out else "Nothing was started."
        print(f"interrupted; finished stages are kept. {where}")
        return 130
    except C.ConfigError:
        raise  # run.py says "config error" and exits 2
    except ValueError as e:  # a stage's own refusal (e.g. an empty distillation corpus): one line
        print(f"pipeline failed: {e}", file=sys.stderr)
        return 1
    print("| model | held-out accuracy | mean response tokens |\n|---|---|---|")
    for name, e in report["stages"].items():
        print(f"| {name} | {e['accuracy']:.3f} | {e['mean_length']:.2f} |")
    print("\n| tier | held-out accuracy | mean response tokens | prompts |\n|---|---|---|---|")
    for t, e in ((t, report["tiers"][t]) for t in TIERS if t in report["tiers"]):
        print(f"| {t} | {e['accuracy']:.3f} | {e['mean_length']:.2f} | {e['prompts']} |")
    print(json.dumps(report))
    return 0
