"""Run configuration: typed msgspec Structs whose defaults are the tiny CPU run, then an optional
TOML file, then dotted overrides (``learner.lr=2e-6``: a TOML literal, else the text itself).
Unknown keys and bad values raise :class:`ConfigError` naming the field path (``$.learner.lr``).
"""

from __future__ import annotations

import functools
import math
import os
import tomllib
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from core import net

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Frac = Annotated[float, Meta(ge=0, le=1)]
FracLt1 = Annotated[float, Meta(ge=0, lt=1)]
Port = Annotated[int, Meta(ge=0, le=65535)]  # 0 = pick a free port at launch
MIN_FRAME_BYTES = 64 << 10  # buffer.max_frame_bytes: a frame carries whole groups; below this, not one
Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: core/precision.py
Device = str  # "auto" | "cpu" | "cuda" | "cuda:N" (core/placement.py)
TIERS = ("default", "low", "medium", "high")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # ray.util.placement_group's


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A config table: an unknown key in it is an error."""


class RunSection(_Section):
    run_dir: str = ""  # empty: runs/<UTC timestamp>, with runs/latest pointing at it
    seed: Annotated[int, Meta(ge=0, lt=1 << 32)] = 0  # engines seed with seed * 1000 + actor index
    max_steps: NonNegInt = 1000  # learner optimiser steps; 0 = no step budget
    max_time_s: NonNegFloat = 480.0  # wall clock from the roles' launch (restarts included); 0 = none
    eval_every: NonNegInt = 10  # held-out eval every N policy versions (actor 0); 0 = off
    eval_prompts: PosInt = 256
    ckpt_every: NonNegInt = 100  # checkpoint every N learner steps and at least every S s (0 = off); and at the end
    ckpt_every_s: NonNegFloat = 120.0
    max_restarts: NonNegInt = 3  # per role; an actor/buffer keeps its data, a learner its checkpoint
    launcher: str = "local"  # core/launchers/ LAUNCHERS: how roles are started and watched
    heartbeat_timeout_s: NonNegFloat = 300.0  # a role whose heartbeat file is this old is hung: restarted; 0 = off
    restart_backoff_s: NonNegFloat = 1.0  # the n-th restart waits base * 2^(n-1) s (at most 30 s)
    stage: str = ""  # the pipeline stage this run is (pipeline.py sets it); shown in the live view
    precision_note: str = ""  # written at launch: what `auto` chose for the dtypes, and why


class ModelSection(_Section):
    path: str = ""  # empty: the task's tiny base model, built once (deterministically) and cached
    vocab_size: NonNegInt = 0  # read from path's config.json at launch; the buffer's token-id bound
    context: NonNegInt = 0  # its max_position_embeddings, read likewise: prompt + completion within it
    cache_dir: str = ".cache/driftrl"
    pretrain_seed: NonNegInt = 0  # the built-in base model's build seed (not run.seed's); 0's is model/shipped/
    hidden_size: PosInt = 128
    num_layers: PosInt = 4
    num_heads: PosInt = 4
    num_kv_heads: PosInt = 2
    intermediate_size: PosInt = 384
    pretrain_steps: NonNegInt = 2400
    pretrain_batch: PosInt = 64
    pretrain_lr: PosFloat = 3e-3
    pretrain_correct_frac: Frac = 0.25  # correct answers; the rest "forget the carry", a habit to unlearn
    pretrain_worked_frac: Frac = 0.1  # scratch: answers with working
    pretrain_redundant_frac: Frac = 0.0  # scratch: worked answers written twice (what distillation removes)
    pretrain_prompt_prefixes: list[str] = []  # one drawn per pre-training prompt (e.g. tier prompts)
    max_position_embeddings: PosInt = 128


class ToolsSection(_Section):  # [task.tools]: multi-turn episodes with a tool (actor/episodes.py)
    # "module:function" (call text -> result text); "" = the task's own (calc: a calculator) or none
    tool: Annotated[str, Meta(pattern=r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*)?$")] = ""
    format: Literal["auto", "brackets", "qwen"] = "auto"  # auto: qwen where </tool_call> is one token
    schema: list[dict] = []  # the tools' JSON schemas, rendered by a chat template's tools block (Qwen's)
    max_turns: PosInt = 4  # policy turns per episode
    workers: PosInt = 2  # sandboxed tool processes: each call within timeout_s, cpu_s, memory_mb, no network
    timeout_s: PosFloat = 5.0
    cpu_s: PosFloat = 2.0
    memory_mb: Annotated[int, Meta(ge=64)] = 512
    network: bool = False


class TaskSection(_Section):
    name: str = "arith"  # actor/tasks/ TASKS
    digits: Annotated[int, Meta(ge=1, le=12)] = 2  # arith: operand digits; scratch: most quotient digits
    min_digits: Annotated[int, Meta(ge=1, le=12)] = 1  # scratch: difficulty ranges min_digits..digits
    eval_frac: Annotated[float, Meta(gt=0, lt=1)] = 0.1
    datasets: list[str] = []  # gym: reasoning_gym dataset names, `size` procedural items each
    size: PosInt = 10000
    # math: JSONL / parquet (`prompt`, `answer`, optional `id`, `level`/`difficulty`); no eval_path:
    path: str = ""  # a hashed eval_frac of `path` is held out
    eval_path: str = ""
    instruction: str = ""  # appended to every prompt (e.g. "Put the final answer in \\boxed{}.")
    chat_template: Literal["auto", "on", "off"] = "auto"  # auto: when the checkpoint has one
    system_prompt: dict[str, str] = {}  # per tier ("default", "low", "medium", "high"); "" = none
    tier_max_new_tokens: dict[str, PosInt] = {}  # per tier, at most actor.max_new_tokens
    difficulty_tiers: dict[str, str] = {}  # str(Prompt.difficulty) -> tier (pipeline tier_by=pass_rate)
    reward_workers: PosInt = 2  # scorer processes; a hung or crashed check scores 0, counted
    reward_timeout_s: PosFloat = 10.0
    tools: ToolsSection = msgspec.field(default_factory=ToolsSection)  # [task.tools]


class SGLangSection(_Section):  # actor.engine = "sglang" (actor/engines/sglang.py): the server, its deadlines
    python: str = ""  # the interpreter of SGLang's separate venv (it pins its own torch)
    mem_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.8
    start_timeout_s: PosFloat = 600.0
    request_timeout_s: PosFloat = 600.0
    update_timeout_s: PosFloat = 300.0


class ActorSection(_Section):
    num_actors: PosInt = 1
    engine: str = "torch"  # actor/engines/ ENGINES: "torch" (embedded) or "sglang" (a server, GPU)
    group_size: Annotated[int, Meta(ge=2)] = 8
    groups_per_batch: PosInt = 16  # prompts decoded together by one engine batch
    skip_uniform_groups: bool = True  # with learner.kl_beta = 0, a group of equal rewards (advantages 0) is not sent
    max_new_tokens: PosInt = 8
    max_batch: PosInt = 256  # continuous batching: sequences decoded at once
    # length curriculum (actor/curriculum.py): length_start, + length_grow every length_every versions
    # ("steps") or when length_clip_rate of the last length_window hit it, up to max_new_tokens
    length_schedule: Literal["off", "steps", "clip_rate"] = "off"
    length_start: PosInt = 8
    length_grow: PosInt = 4
    length_every: PosInt = 20
    length_clip_rate: Annotated[float, Meta(gt=0, le=1)] = 0.2
    length_window: PosInt = 256
    temperature: PosFloat = 1.0
    top_k: NonNegInt = 0  # 0 = off
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    dtype: Dtype = "auto"  # the engine's numerics (FP32 softmax and LM head either way)
    fp32_attn_softmax: bool = True
    threads: PosInt = 1
    # the batch in generation, prefixes included, saved this often (actor/partial.py) for a restarted actor; 0 = off
    partial_save_s: NonNegFloat = 10.0
    device: Device | list[Device] = "auto"  # one for every actor, or a list with one per actor
    sglang: SGLangSection = msgspec.field(default_factory=SGLangSection)  # [actor.sglang]


class BufferSection(_Section):
    max_staleness: NonNegInt = 2
    policy: Literal["drop_stale", "oldest_first"] = "drop_stale"
    capacity_groups: PosInt = 1024
    capacity_bytes: PosInt = 256 * 1024 * 1024
    max_frame_bytes: Annotated[int, Meta(ge=MIN_FRAME_BYTES)] = 64 * 1024 * 1024
    persist: bool = True  # buffer/durable.py: SQLite in run_dir/buffer/ (false: in memory)
    fsync: Literal["always", "batch", "never"] = "batch"  # commit per group / per loop turn / no fsync
    max_prompt_tokens: PosInt = 4096  # nor empty (completions: actor.max_new_tokens, group_size, vocab_size)
    # drop: train on what has arrived, groups still being generated may go stale; wait: hold the learner
    # (up to stale_wait_s per actor) for groups in generation that its next step would make stale
    stale_strategy: Literal["drop", "wait"] = "drop"
    stale_wait_s: PosFloat = 30.0


class LearnerSection(_Section):
    backend: str = "torch"  # learner/backends/ BACKENDS
    groups_per_step: PosInt = 16
    lr: PosFloat = 1e-4
    weight_decay: NonNegFloat = 0.0
    betas: tuple[FracLt1, FracLt1] = (0.9, 0.99)  # Adam's: in [0, 1)
    grad_clip: NonNegFloat = 1.0  # 0 = off
    loss: str = "ring_zero"  # learner/losses/ LOSSES
    eps_high: PosFloat = 2.0  # Ring-Zero/TIS upper truncation of the ratio
    eps_clip: Annotated[float, Meta(gt=0, lt=1)] = 0.2  # PPO-clip only: the ratio within 1 -/+ eps_clip
    norm: Literal["token", "sample"] = "token"
    kl_beta: NonNegFloat = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    body_dtype: Dtype = "auto"  # the body's matmuls; master weights, optimiser, islands stay FP32
    fp32_attn_softmax: bool = True
    fp32_head: bool = True
    logprob_chunk: PosInt = 1024  # tokens per FP32 head chunk
    micro_batch_tokens: NonNegInt = 8192  # gradient accumulation: padded tokens per micro-batch; 0 = one
    # torch backend: each layer's activations recomputed in backward, only its input kept: the body's
    # activations no longer scale with micro_batch_tokens x layers, for one more body forward a step
    checkpoint_layers: bool = False
    threads: PosInt = 1
    device: Device = "auto"
    context_parallel: PosInt = 1  # ranks each sequence is split across (model/context_parallel.py); torch backend
    tail_k: NonNegInt = 8  # the k highest/lowest-ratio tokens per step to tail.jsonl (`run.py tail`); 0 = off
    # start-up contract check (learner/contract.py). BF16 engine vs BF16-body learner, both islands:
    # mean |dlogp| 0.058, k3 3.5e-3 (bench/precision.py); a one-sided temperature is far above both
    contract_max_abs_logp_diff: PosFloat = 0.1
    contract_max_kl_k3: PosFloat = 0.01


class WeightSyncSection(_Section):
    transport: str = "shm"  # weightsync.PUBLISHERS (ARCHITECTURE.md's seam table)
    bucket_mb: PosInt = 64
    join_timeout_s: PosFloat = 900.0  # nccl / torch_dist: every actor joining, a server's start included
    # a version as the elements that changed, in the actors' dtype (weightsync/delta.py); auto: on for 16-bit
    # actors over filesystem or nccl. A full version goes first, every full_every versions and when smaller
    delta: Literal["auto", "on", "off"] = "auto"
    full_every: PosInt = 50


class NetSection(_Section):
    host: str = "127.0.0.1"
    buffer_actor_port: Port = 0  # 0 = pick a free port at launch
    buffer_learner_port: Port = 0
    curve_server_public: str = ""  # ZeroMQ CURVE keys (z85), required off loopback
    curve_server_secret: str = ""
    curve_client_public: str | list[str] = ""  # the servers' allow-list
    curve_client_secret: str = ""


class RaySection(_Section):  # core/launchers/ray.py: what each role's Ray actor asks for (logical CPUs)
    address: str = ""  # "" = start a local Ray instance; HOST:PORT or "auto" joins a cluster
    actor_cpus: PosFloat = 1.0
    learner_cpus: PosFloat = 1.0
    buffer_cpus: PosFloat = 1.0
    actor_gpus: NonNegFloat = 0.0
    learner_gpus: NonNegFloat = 0.0
    actor_resources: dict[str, float] = {}  # custom Ray resources per role (e.g. `{node2 = 1}`): pin roles to nodes
    learner_resources: dict[str, float] = {}
    buffer_resources: dict[str, float] = {}
    placement_strategy: str = "PACK"  # ray.util.placement_group's: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    start_timeout_s: PosFloat = 120.0  # placement group ready, host actors answering


class MonitorSection(_Section):
    live: Literal["auto", "on", "off"] = "auto"  # auto: rich Live on a TTY, plain lines otherwise
    refresh_s: PosFloat = 1.0
    plain_every_s: PosFloat = 10.0  # plain lines: at most one per this; a keep-alive every 6 x


class MetricsSection(_Section):
    tensorboard: bool = False  # also run_dir/tensorboard/ event files (extra `tensorboard`)


class ControlSection(_Section):  # the learner acting on its ratio tail (learner/control.py)
    # adaptive staleness: the limit moves by 1 in [staleness_min, staleness_max]: down when the p99 at
    # the highest lag exceeds the target, up below target * (1 - hysteresis), dwell_steps apart
    adaptive_staleness: bool = False
    staleness_min: NonNegInt = 0
    staleness_max: NonNegInt = 8
    # clean default run at lag 2: p99 median 1.20, max 1.78; 1.5 keeps eps_high truncation rare
    ratio_p99_target: Annotated[float, Meta(gt=1)] = 1.5  # the p99 of ratios with mean ~1 is above 1
    hysteresis: FracLt1 = 0.1
    dwell_steps: NonNegInt = 10
    # guard-rails (0 or null = off), well outside clean default runs (README: guard-rails): ~1.7x the
    # largest p99, ~3x the largest max, ~9x below the smallest min, ~6x k3, ~3x lag-0 |Δ log p|
    guard_ratio_p99: NonNegFloat | None = 3.0
    guard_ratio_max: NonNegFloat | None = 10.0
    guard_ratio_min: NonNegFloat | None = 0.02  # fires at or below: a low tail starves gradients
    guard_kl_k3: NonNegFloat | None = 0.1
    # |Δ log p| p99 of the lag-0 tokens: the engine/learner numerics gap alone (no policy drift)
    guard_abs_logp_diff_p99_s0: NonNegFloat | None = 0.75
    guard_nonfinite: bool = True  # any NaN/inf ratio/* or mismatch/* value
    # warn · skip_step: drop the batch · pause_actors: until pause_steps clean steps (or an empty
    # buffer) · rollback: newest checkpoint under a fresh version, its successors' samples dropped
    guard_action: Literal["warn", "skip_step", "pause_actors", "rollback"] = "warn"
    pause_steps: PosInt = 8


class DistillSection(_Section):  # the pipeline's self-distillation (actor/distill.py, learner/sft.py)
    prompts: PosInt = 2048
    samples: Annotated[int, Meta(ge=2)] = 8  # per training prompt; the shortest correct one is kept
    compress_prompt: str = ""  # a rewrite pass: the kept completion + this text asks for a shorter one; "" = off
    lr: PosFloat = 1e-3
    epochs: PosInt = 2
    batch: PosInt = 32


class PipelineSection(_Section):  # run.py pipeline: each RL stage's table is a partial config over RECIPE's
    tier_by: Literal["level", "pass_rate"] = "level"  # the levels in thirds, or by rl2's held-out pass rate
    rl1: dict[str, Any] = {}
    rl2: dict[str, Any] = {}
    tiers: dict[str, Any] = {}


class Config(_Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    task: TaskSection = msgspec.field(default_factory=TaskSection)
    actor: ActorSection = msgspec.field(default_factory=ActorSection)
    buffer: BufferSection = msgspec.field(default_factory=BufferSection)
    learner: LearnerSection = msgspec.field(default_factory=LearnerSection)
    weightsync: WeightSyncSection = msgspec.field(default_factory=WeightSyncSection)
    net: NetSection = msgspec.field(default_factory=NetSection)
    ray: RaySection = msgspec.field(default_factory=RaySection)
    monitor: MonitorSection = msgspec.field(default_factory=MonitorSection)
    control: ControlSection = msgspec.field(default_factory=ControlSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    distill: DistillSection = msgspec.field(default_factory=DistillSection)
    pipeline: PipelineSection = msgspec.field(default_factory=PipelineSection)


class ConfigError(ValueError):
    """A bad key or value; the message names its field path (``$.section.key``), one line (controls escaped)."""

    def __init__(self, msg: str):
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(msg)))


@functools.cache
def _map_fields() -> frozenset[str]:
    """Paths of the fields that are maps, not sections: their keys are the user's (tiers, stages)."""
    return frozenset(f"$.{sec.name}.{f.name}" for sec in msgspec.inspect.type_info(Config).fields
                     for f in sec.type.fields if isinstance(f.type, msgspec.inspect.DictType))


def _known(node, key: str, where: str) -> bool:
    return isinstance(node, dict) and (key in node or any(f"{where}.".startswith(m + ".") for m in _map_fields()))


def apply_override(tree: dict, item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict built from the config; unknown paths raise (a map
    field, like ``task.system_prompt``, takes new keys: ``task.system_prompt.low="..."``)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    path, _, raw = item.partition("=")
    keys, node = path.strip().split("."), tree
    for depth, k in enumerate(keys):
        if not _known(node, k, "$." + ".".join(keys[:depth])):
            raise ConfigError(f"unknown config key `$.{'.'.join(keys[: depth + 1])}`")
        if depth < len(keys) - 1:
            node = node.setdefault(k, {})
    try:
        node[keys[-1]] = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:  # not a TOML literal: the text itself
        node[keys[-1]] = raw.strip()


def merge(base: dict, top: dict, where: str = "$", path: str = "$") -> None:
    """Merge the partial config tree ``top`` into ``base`` (the subtree at ``path``) in place;
    an unknown key is named under ``where`` (where ``top`` came from, e.g. ``$.pipeline.rl1``)."""
    for k, v in top.items():
        if not _known(base, k, path):
            raise ConfigError(f"unknown config key `{where}.{k}`")
        if isinstance(base.get(k), dict) and isinstance(v, dict) and f"{path}.{k}" not in _map_fields():
            merge(base[k], v, f"{where}.{k}", f"{path}.{k}")
        else:
            base[k] = v


def from_dict(tree: dict) -> Config:
    try:
        cfg = msgspec.convert(tree, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid config: {e}") from None
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field rules that per-field types cannot state (token limits: within what the buffer admits)."""
    _check_finite(msgspec.to_builtins(cfg))
    if cfg.learner.groups_per_step % cfg.actor.num_actors:
        raise ConfigError("`$.learner.groups_per_step` must be a multiple of `$.actor.num_actors` "
                          f"({cfg.learner.groups_per_step} % {cfg.actor.num_actors} != 0): each actor owns "
                          "an equal share of the admission quota")
    if cfg.run.max_steps == 0 and cfg.run.max_time_s == 0:
        raise ConfigError("set `$.run.max_steps` or `$.run.max_time_s`: a run needs a budget")
    cap, t, r = cfg.actor.max_new_tokens, cfg.task, cfg.ray
    for name, tiers in (("system_prompt", t.system_prompt), ("tier_max_new_tokens", t.tier_max_new_tokens),
                        ("difficulty_tiers", t.difficulty_tiers.values())):
        if bad := sorted(set(tiers) - set(TIERS)):
            raise ConfigError(f"`$.task.{name}` has {bad}: tiers are {', '.join(TIERS)}")
    if over := {k: n for k, n in t.tier_max_new_tokens.items() if n > cap}:
        raise ConfigError(f"`$.task.tier_max_new_tokens` = {over} exceeds `$.actor.max_new_tokens` = {cap}")
    if cfg.actor.length_schedule != "off" and cfg.actor.length_start > cap:
        raise ConfigError(f"`$.actor.length_start` = {cfg.actor.length_start} exceeds `$.actor.max_new_tokens` = {cap}")
    if r.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"`$.ray.placement_strategy` = {r.placement_strategy!r} is not one of "
                          f"{', '.join(PLACEMENT_STRATEGIES)}")
    for name in ("actor_resources", "learner_resources", "buffer_resources"):
        if bad := {k: v for k, v in getattr(r, name).items() if not v > 0 or k in ("CPU", "GPU")}:
            raise ConfigError(f"`$.ray.{name}` = {bad}: custom resources need amounts above 0 "
                              "(CPUs and GPUs have their own fields)")
    _validate_net(cfg.net)
    _validate_model(cfg.model)
    _validate_context_parallel(cfg)
    c, max_staleness = cfg.control, cfg.buffer.max_staleness
    if c.staleness_min > c.staleness_max:
        raise ConfigError(f"`$.control.staleness_max` = {c.staleness_max} is below "
                          f"`$.control.staleness_min` = {c.staleness_min}")
    if c.adaptive_staleness and not c.staleness_min <= max_staleness <= c.staleness_max:
        raise ConfigError(f"`$.buffer.max_staleness` = {max_staleness} (the adaptive limit's start) is outside "
                          f"[`$.control.staleness_min`, `$.control.staleness_max`] = "
                          f"[{c.staleness_min}, {c.staleness_max}]")
    # a ratio threshold on the wrong side of 1 would fire on every clean step
    for name, side in (("guard_ratio_p99", "above"), ("guard_ratio_max", "above"), ("guard_ratio_min", "below")):
        if (v := getattr(c, name)) and (v <= 1.0 if side == "above" else v >= 1.0):
            raise ConfigError(f"`$.control.{name}` = {v} must be {side} 1 (or 0 = off)")


def _check_finite(node, path: str = "$") -> None:
    """Every float anywhere in the config (a builtins tree) is finite: NaN passes no range, JSON has no inf."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"`{path}` = {node}: must be a finite number")
    for k, v in node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ():
        _check_finite(v, f"{path}.{k}" if isinstance(node, dict) else f"{path}[{k}]")


def _validate_model(m: ModelSection) -> None:
    h, n, kv = m.hidden_size, m.num_heads, m.num_kv_heads
    for bad, why in ((h % n, f"`$.model.hidden_size` = {h} is not a multiple of `$.model.num_heads` = {n}"),
                     (n % kv, f"`$.model.num_heads` = {n} is not a multiple of `$.model.num_kv_heads` = {kv}"),
                     (h // n % 2, f"`$.model.hidden_size` / `$.model.num_heads` = {h // n}: RoPE needs it even")):
        if bad:
            raise ConfigError(why)


def _validate_context_parallel(cfg: Config) -> None:
    cp, room = cfg.learner.context_parallel, cfg.buffer.max_prompt_tokens + cfg.actor.max_new_tokens
    if cp > 1 and cfg.learner.backend == "megatron":
        raise ConfigError(f"`$.learner.context_parallel` = {cp} needs learner.backend='torch': megatron-core's "
                          "context_parallel_size runs only in TEDotProductAttention (Transformer Engine, CUDA), "
                          "not in the local spec's DotProductAttention that its CPU path uses")
    if cp > room:
        raise ConfigError(f"`$.learner.context_parallel` = {cp} exceeds the longest sequence, {room} tokens "
                          "(`$.buffer.max_prompt_tokens` + `$.actor.max_new_tokens`): a rank would hold only padding")


def _validate_net(n: NetSection) -> None:
    """A valid host; off loopback, CURVE with a client allow-list; well-formed keys."""
    try:
        net.check_host(n.host)
    except ValueError as e:
        raise ConfigError(f"`$.net.host`: {e}") from None
    curve = bool(n.curve_server_public or n.curve_server_secret)
    if not net.is_loopback(n.host) and not curve:
        raise ConfigError(f"`$.net.host` = {n.host!r} is not loopback: set the CURVE keys "
                          "`$.net.curve_server_public/secret` and the client allow-list "
                          "`$.net.curve_client_public` (see core/net.py: make_curve_keys)")
    if curve and not (n.curve_server_public and n.curve_server_secret):
        raise ConfigError("CURVE needs both `$.net.curve_server_public` and `$.net.curve_server_secret`")
    if curve and not net.client_keys(n):
        raise ConfigError("CURVE without a client allow-list admits any key pair: set "
                          "`$.net.curve_client_public` (one key or a list)")
    keys = [(m, getattr(n, m)) for m in ("curve_server_public", "curve_server_secret", "curve_client_secret")]
    for name, key in keys + [(f"curve_client_public[{i}]", k) for i, k in enumerate(net.client_keys(n))]:
        try:
            if key:
                net.check_curve_key(key)
        except ValueError as e:
            raise ConfigError(f"`$.net.{name}`: {e}") from None


def load(toml_path: str | None = None, overrides: list[str] | tuple = ()) -> Config:
    tree = msgspec.to_builtins(Config())
    if toml_path:
        try:
            with open(toml_path, "rb") as f:
                merge(tree, tomllib.load(f))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            why = f"not UTF-8 ({e})" if isinstance(e, UnicodeDecodeError) else e
            raise ConfigError(f"cannot read config file {toml_path}: {why}") from None
    for item in overrides:
        apply_override(tree, item)
    cfg = from_dict(tree)  # + a fresh config's checks (not validate(): a run dir's config.json may have moved)
    if not cfg.model.path and cfg.actor.max_new_tokens >= (pos := cfg.model.max_position_embeddings):  # built-in
        raise ConfigError(f"`$.actor.max_new_tokens` = {cfg.actor.max_new_tokens} leaves no room for a prompt "
                          f"within `$.model.max_position_embeddings` = {pos}")
    p = cfg.run.run_dir and os.path.realpath(cfg.run.run_dir)  # can be made or written
    while p and not os.path.exists(p):  # its nearest existing ancestor; nothing is created
        p = os.path.dirname(p)
    if p and (not os.path.isdir(p) or not os.access(p, os.W_OK | os.X_OK) or p.split("/")[1] in ("proc", "sys")):
        raise ConfigError(f"`$.run.run_dir` = {cfg.run.run_dir!r} cannot be created or written (at {p})")
    return cfg


def to_json(cfg: Config) -> bytes:
    return msgspec.json.format(msgspec.json.encode(cfg), indent=2)


def from_json(data: bytes) -> Config:
    return from_dict(msgspec.json.decode(data))
