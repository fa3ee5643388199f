"""The built-in base model: build it, measure its start on held-out prompts, and (``--ship``)
put it in ``model/shipped/`` so the default job starts from these exact weights on every CPU.

    python bench/base_model.py [section.key=value ...] [--seeds 0,1,2] [--ship]

Why shipped: the build's outcome depends on the CPU and the seed (float summation order differs
between AVX2, AVX-512 and AMX kernels, and a 1200-step build of seed 0 on an AVX2 EPYC learnt
almost no arithmetic: 86 % of its answers neither the sum nor its reversal, seed 1's 22 %), so a
newcomer's first run depended on which machine they had. The shipped model is the default
recipe's build (``model.pretrain_seed``) made once; its sha256 is in its ``driftrl_base.json``
and checked on every load (``model/basemodel.py: verified``).

For each run seed (the engine's sampling seed, as ``run.seed`` seeds a run's actor) it prints
the held-out reward the way a run's first evaluation measures it (``run.eval_prompts`` prompts,
sampled at the training temperature, FP32) and the share of answers that are the sum, its digits
reversed (the habit RL must remove) or neither. Last line: JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from actor.engines import make_engine  # noqa: E402
from actor.tasks import make_task, task_class  # noqa: E402
from core import config as C  # noqa: E402
from model import basemodel  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402


def start_rewards(cfg, model_dir: str, seeds: list[int]) -> dict[int, dict[str, float]]:
    """Per run seed: held-out reward and the answer shares, as a run's first evaluation samples."""
    task = make_task(cfg.task, Tokenizer.from_dir(model_dir))
    prompts = task.eval_set(cfg.run.eval_prompts)
    out = {}
    for seed in seeds:
        samples = make_engine(cfg.actor, model_dir, seed=seed).generate([list(p.tokens) for p in prompts])
        kinds = collections.Counter()
        for p, s in zip(prompts, samples):
            text = task.completion_text(s.tokens)
            kinds["sum" if text == p.answer else "reversed" if text == (p.answer or "")[::-1] else "neither"] += 1
        out[seed] = {"reward": kinds["sum"] / len(prompts), **{k: kinds[k] / len(prompts) for k in ("reversed", "neither")}}
    return out


def ship(model_dir: str, name: str) -> str:
    """Copy the built model into model/shipped/NAME with the sha256 of its weights recorded."""
    dest = os.path.join(basemodel.SHIPPED, name)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(model_dir, dest)
    record_path = os.path.join(dest, "driftrl_base.json")
    with open(record_path) as f:
        record = json.load(f)
    with open(os.path.join(dest, "model.safetensors"), "rb") as f:
        record["sha256"] = basemodel.hashlib.file_digest(f, "sha256").hexdigest()
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)
    return basemodel.verified(dest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--ship", action="store_true", help="copy the build into model/shipped/")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        cfg = C.load(None, [*args.overrides, f"model.cache_dir={json.dumps(cache)}", 'actor.dtype="float32"'])
        cls = task_class(cfg.task.name)
        name = f"base-{cfg.task.name}-{basemodel.recipe_key(cfg, {})}"
        shipped = basemodel.SHIPPED
        if args.ship:  # build it here, whatever is shipped now
            basemodel.SHIPPED = os.path.join(cache, "nothing-shipped")
        t0 = time.time()
        model_dir = cls.base_model(cfg)
        basemodel.SHIPPED = shipped
        build_s = time.time() - t0
        rewards = start_rewards(cfg, model_dir, [int(s) for s in args.seeds.split(",")])
        where = ship(model_dir, name) if args.ship else model_dir
    for seed, row in rewards.items():
        print(f"run.seed {seed}: held-out reward {row['reward']:.3f}  reversed {row['reversed']:.3f}  "
              f"neither {row['neither']:.3f}")
    band = max(r["reward"] for r in rewards.values()) - min(r["reward"] for r in rewards.values())
    print(json.dumps({"model": name, "build_s": round(build_s, 1), "shipped": args.ship, "path": where,
                      "start": rewards, "band": band}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
