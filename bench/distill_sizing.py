"""How big a self-distillation corpus has to be: the distilled model against the policy it came from.

    python bench/distill_sizing.py PIPELINE_DIR [--prompts 2048,8192] [--samples 8] [--epochs 5] [--k 8]

For each corpus size, the rl1 policy of a finished (or at least rl1-done) pipeline run samples
``--samples`` completions per training prompt, the shortest correct ones are kept and the base
model is fine-tuned on them (``actor/distill.py``, ``learner/sft.py``: the pipeline's own
functions, its own config), into ``PIPELINE_DIR/distill-sizing/``. Both models are then
evaluated the pipeline's way (``pipeline.evaluate_model``: ``run.eval_prompts`` held-out
problems x ``--k`` samples), and for the built-in scratch task the share of answers that carry a
redundant check (written out twice: two ``:``) is counted, in the corpus and in each model's
held-out answers. The defaults of ``configs/pipeline.toml`` (8,192 prompts, 5 epochs) were chosen
with it; its figures are in that file's comments. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipeline as P  # noqa: E402
from core.files import read_json  # noqa: E402
from actor.distill import build_corpus  # noqa: E402
from actor.engines import make_engine  # noqa: E402
from actor.evaluate import sample_k  # noqa: E402
from actor.tasks import make_task  # noqa: E402
from learner.sft import finetune  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402


def checked_share(texts) -> float:
    """Share of answers written out twice (scratch: more than one ``:``); None answers count as not."""
    return sum(t is not None and t.count(":") > 1 for t in texts) / max(len(texts), 1)


def model_checked(cfg, model_dir: str, k: int) -> float:
    engine, task = make_engine(cfg.actor, model_dir, seed=cfg.run.seed), make_task(cfg.task, Tokenizer.from_dir(model_dir))
    try:
        samples, _ = sample_k(engine, task, task.eval_set(cfg.run.eval_prompts), k)
        return checked_share([task.completion_text(s.tokens) for ss in samples for s in ss])
    finally:
        task.close()
        engine.close()


def corpus_checked(corpus: str, model_dir: str) -> float:
    tok = Tokenizer.from_dir(model_dir)
    with open(corpus) as f:
        rows = [json.loads(line) for line in f]
    return checked_share([tok.decode([t for t in r["completion"] if t not in tok.eos_ids]) for r in rows])


def one_size(base: dict, out: str, prompts: int, samples: int, epochs: int, k: int, rl1: str) -> dict:
    where = os.path.join(out, "distill-sizing", f"p{prompts}-s{samples}-e{epochs}")
    cfg = P.stage_config(base, "distill", rl1, where,
                         {"distill": {"prompts": prompts, "samples": samples, "epochs": epochs}})
    os.makedirs(where, exist_ok=True)
    corpus, model = os.path.join(where, "corpus.jsonl"), os.path.join(where, "model")
    stats = build_corpus(cfg, rl1, corpus)
    finetune(cfg, base["model"]["path"], corpus, model, cfg.run.seed)
    ev = P.evaluate_model(cfg, model, k)
    return {"prompts": prompts, "samples": samples, "epochs": epochs, "corpus": stats["corpus"],
            "distilled_accuracy": ev["accuracy"], "distilled_length": ev["mean_length"],
            "corpus_checked": corpus_checked(corpus, rl1), "distilled_checked": model_checked(cfg, model, k)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pipeline_dir")
    ap.add_argument("--prompts", default="2048,8192", help="corpus sizes to try (training prompts), comma-separated")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--k", type=int, default=8)
    args = ap.parse_args(argv)
    out = os.path.abspath(args.pipeline_dir)
    base, rl1 = read_json(os.path.join(out, "config.json")), os.path.join(out, "rl1", "final_model")
    if base is None or not os.path.isdir(rl1):
        print(f"{out}: not a pipeline directory whose rl1 stage is done", file=sys.stderr)
        return 2
    cfg = P.stage_config(base, "distill", rl1, os.path.join(out, "distill-sizing"))
    ref = {**P.evaluate_model(cfg, rl1, args.k), "checked": model_checked(cfg, rl1, args.k)}
    rows = [one_size(base, out, int(n), args.samples, args.epochs, args.k, rl1) for n in args.prompts.split(",")]
    print(f"rl1: accuracy {ref['accuracy']:.3f}, mean length {ref['mean_length']:.2f}, checked {ref['checked']:.3f}")
    for r in rows:
        print(f"{r['prompts']:>6} prompts x {r['samples']} ({r['corpus']} kept, {r['epochs']} epochs): distilled "
              f"{r['distilled_accuracy']:.3f} / {r['distilled_length']:.2f} tokens; checked: corpus "
              f"{r['corpus_checked']:.3f}, distilled {r['distilled_checked']:.3f}")
    print(json.dumps({"bench": "distill_sizing", "rl1": {k: ref[k] for k in ("accuracy", "mean_length", "checked")},
                      "sizes": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
