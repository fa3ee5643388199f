"""The wiring library below the drivers (run.py, pipeline.py, sweep.py, bench/): one job from a
config to a finished run directory, the one place both the actor's and the learner's sides meet.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time

import msgspec

from actor.tasks import TASKS, make_task, task_class
from core import config as C
from core import funnel, launchers, placement, precision, proc
from core.files import read_json
from core.metrics import MERGED_FILE, FileTail, read_all
from learner import checkpoint
from learner.backends import BACKENDS, make_backend
from weightsync import DELIVERS, PUBLISHERS, check_devices

log = logging.getLogger("driftrl")


def load_config(toml_path, resume_dir, overrides) -> C.Config:
    if resume_dir is None:
        return C.load(toml_path, overrides)
    tree = read_json(os.path.join(resume_dir, "config.json"))
    if tree is None:
        raise C.ConfigError(f"{resume_dir}/config.json is missing or not JSON: not a driftrl run directory")
    tree["net"].update(buffer_actor_port=0, buffer_learner_port=0)  # the old ones may be taken by now
    tree["net"].pop("metrics_port", None)  # config.json of runs from before metrics were files
    tree["buffer"].pop("segment_bytes", None)  # ... and before the buffer's store was SQLite
    for item in overrides:
        C.apply_override(tree, item)
    return C.from_dict(tree)


def check_seams(cfg: C.Config) -> None:
    """Every seam's config value names a registered implementation (before anything starts)."""
    from actor.engines import ENGINES, engine_class
    from learner.losses import LOSSES

    for path, registry in (("actor.engine", ENGINES), ("task.name", TASKS), ("learner.backend", BACKENDS),
                           ("learner.loss", LOSSES), ("weightsync.transport", PUBLISHERS),
                           ("run.launcher", launchers.LAUNCHERS)):
        section, key = path.split(".")
        if (value := getattr(getattr(cfg, section), key)) not in registry:
            raise C.ConfigError(f"`$.{path}` = {value!r} is not one of {', '.join(sorted(registry))}")
    receives, transport = engine_class(cfg.actor.engine).receives, cfg.weightsync.transport
    if transport not in DELIVERS[receives]:
        raise C.ConfigError(f"`$.actor.engine` = {cfg.actor.engine!r} receives weights as {receives!r}, which "
                            f"`$.weightsync.transport` = {transport!r} does not deliver: set it to "
                            f"{' or '.join(map(repr, DELIVERS[receives]))}")
    check_devices(cfg)  # a CUDA device asked for where there is none fails here, not in a role
    # an optional stack that is chosen but not installed fails here, in a second, with its extra
    stacks = ((cfg.metrics.tensorboard, "tensorboardX", "`$.metrics.tensorboard` = true", "tensorboard"),
              (cfg.run.launcher == "ray", "ray", "`$.run.launcher` = 'ray'", "ray"))
    for chosen, module, what, extra in stacks:
        if chosen and importlib.util.find_spec(module) is None:
            raise C.ConfigError(f"{what} needs {module}: pip install -e '.[{extra}]'")


def resolve_model(cfg: C.Config) -> C.Config:
    """``model.path`` set (empty: the task's tiny model, built on first use), ``model.vocab_size``, ``.context``."""
    path = cfg.model.path
    if path and not os.path.exists(os.path.join(path, "config.json")):
        raise C.ConfigError(f"`$.model.path` = {path!r} has no config.json")
    if not path:
        t0 = time.time()
        try:
            path = task_class(cfg.task.name).base_model(cfg)
        except ValueError as e:
            raise C.ConfigError(f"`$.model.path` is empty: {e}") from None
        log.info("base model ready in %.1fs: %s", time.time() - t0, path)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)  # the built-in's max_position_embeddings is model.max_position_embeddings
    m = msgspec.structs.replace(cfg.model, path=path, vocab_size=int(hf["vocab_size"]),
                                context=int(hf.get("max_position_embeddings") or 0))  # 0: unknown
    if m.context and (n := cfg.actor.max_new_tokens) >= m.context:
        raise C.ConfigError(f"`$.actor.max_new_tokens` = {n} leaves no room for a prompt (context {m.context}: {path})")
    return msgspec.structs.replace(cfg, model=m)


def contract_check(cfg: C.Config, run_dir: str | None) -> dict:
    """Engine and backend, built as the roles build them, score one batch alike (resuming: the newest checkpoint)."""
    import torch

    from actor.engines import make_engine
    from learner import contract
    from model.sampling import SamplingSpec
    from model.tokenizer import Tokenizer

    torch.set_num_threads(1)
    ck = checkpoint.latest(os.path.join(run_dir, "checkpoints")) if run_dir else None
    model_dir = os.path.join(ck, "model") if ck else cfg.model.path
    engine = make_engine(cfg.actor, model_dir, seed=cfg.run.seed)
    task = make_task(cfg.task, Tokenizer.from_dir(model_dir))
    # with context parallelism too, one rank's: the group computes what one rank does (test_context_parallel.py)
    one = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner, context_parallel=1))
    return contract.check(make_backend(one, model_dir), engine, task, SamplingSpec.of(cfg.actor),
                          cfg.learner.contract_max_abs_logp_diff, cfg.learner.contract_max_kl_k3)


def train(cfg: C.Config, run_dir: str | None = None, monitor=None, on_ready=None) -> launchers.RunResult:
    from weightsync.files import remove_dead_region

    check_seams(cfg)
    cfg = resolve_model(cfg)
    cfg, note = precision.resolve(cfg, *placement.check(cfg))  # (check_seams checked the transport)
    log.info("precision: %s", note)
    log.info("contract check passed: %s", contract_check(cfg, run_dir))
    run_dir = os.path.abspath(run_dir or cfg.run.run_dir or launchers.new_run_dir())
    try:
        return launchers.make_launcher(cfg).run(run_dir, monitor, on_ready)
    finally:  # a learner that died for good leaves no shared-memory region behind
        remove_dead_region(run_dir)


def funnel_of(run_dir: str):
    return funnel.from_records(read_all(FileTail(os.path.join(run_dir, MERGED_FILE))))


def learner_memory(run_dir: str) -> dict[str, float | None] | None:
    """The run's :func:`core.proc.learner_memory`."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return proc.learner_memory(map(json.loads, f))


def first_eval(run_dir: str) -> float | None:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        evals = (r for r in map(json.loads, f) if r.get("eval/reward") is not None and not r.get("eval/final"))
        return next((r["eval/reward"] for r in evals), None)


def resolve_checkpoint(path: str) -> tuple[str, str | None]:
    """``(model_dir, run config path or None)`` of a run (its ``final_model``, else its newest
    intact checkpoint), a pipeline (its last stage), a checkpoint or a model directory."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "pipeline.json")):
        path = os.path.join(path, "tiers")
    run_cfg, final = os.path.join(path, "config.json"), os.path.join(path, "final_model")
    if os.path.isdir(final):
        return final, run_cfg
    if os.path.isdir(os.path.join(path, "checkpoints")):
        ck = checkpoint.latest(os.path.join(path, "checkpoints"))
        if ck is None:
            raise FileNotFoundError(f"run {path} has neither final_model/ nor an intact checkpoint")
        return os.path.join(ck, "model"), run_cfg
    if os.path.exists(os.path.join(path, "model", "config.json")):
        return os.path.join(path, "model"), None
    if os.path.exists(run_cfg):
        return path, None
    raise FileNotFoundError(f"{path} is not a run, checkpoint or model directory (no config.json)")
