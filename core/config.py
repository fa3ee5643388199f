"""Run configuration: typed msgspec Structs whose defaults are the tiny CPU run.

Resolution order: struct defaults < optional TOML file < dotted overrides
(``python run.py learner.lr=2e-6 buffer.max_staleness=4``). Unknown keys and bad values raise
:class:`ConfigError` naming the field path (``$.learner.lr``). Override values are parsed as TOML
literals (``4``, ``2e-6``, ``true``, ``"x"``, ``[1, 2]``); anything else is taken as a string.
"""

from __future__ import annotations

import functools
import tomllib
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from core import net

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: core/precision.py
# "auto" | "cpu" | "cuda" | "cuda:N" (core/placement.py resolves and validates it)
Device = str


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A config section: unknown keys are errors, fields are keyword-only."""


class RunSection(_Section):
    run_dir: str = ""  # empty: runs/<UTC timestamp>, with runs/latest pointing at it
    seed: int = 0
    max_steps: NonNegInt = 1000  # learner optimiser steps; 0 = no step budget
    # wall-clock budget from the launch of the roles (a restarted learner spends what is left); 0 = none
    max_time_s: NonNegFloat = 480.0
    eval_every: NonNegInt = 10  # held-out eval every N policy versions (actor 0); 0 = off
    eval_prompts: PosInt = 256
    # checkpoints every N learner steps and at least every S seconds (0 = off); the final one
    # always. A crashed learner resumes from the newest (learner/loop.py), so they bound lost work
    ckpt_every: NonNegInt = 100
    ckpt_every_s: NonNegFloat = 120.0
    # a crashed role is restarted this often (each role counted alone): an actor or the buffer
    # (their data survives: spool / segment log), the learner (from its newest checkpoint)
    max_restarts: NonNegInt = 3
    # seams (ARCHITECTURE.md): a key of its registry, checked by run.py before anything starts
    launcher: str = "local"  # core/launchers/ LAUNCHERS: how roles are started and watched
    # a role whose heartbeat file (run_dir/heartbeat/<role>) has not moved for this long is hung:
    # SIGKILLed and restarted like a crashed one. A real learner step can be long; 0 = off
    heartbeat_timeout_s: NonNegFloat = 300.0
    # the n-th restart of a role waits base * 2^(n-1) s (at most 30 s) after its crash: a role
    # that fails at once is not restarted in a tight loop; 0 = restart at once
    restart_backoff_s: NonNegFloat = 1.0
    stage: str = ""  # the pipeline stage this run is (pipeline.py sets it); shown in the live view
    # written by run.py: what `auto` chose for learner.body_dtype and actor.dtype, and why
    precision_note: str = ""


class ModelSection(_Section):
    # empty path: build (once, deterministically, then cached) the tiny base model of `task`
    path: str = ""
    # resolved by run.py from path's config.json; the buffer rejects token ids outside it (0: unset)
    vocab_size: NonNegInt = 0
    cache_dir: str = ".cache/driftrl"
    # the built-in base model's build seed (run.seed leaves the base model alone, so runs with
    # different seeds start from the same model); the default recipe's build ships in model/shipped/
    pretrain_seed: NonNegInt = 0
    hidden_size: PosInt = 128
    num_layers: PosInt = 4
    num_heads: PosInt = 4
    num_kv_heads: PosInt = 2
    intermediate_size: PosInt = 384
    pretrain_steps: NonNegInt = 2400
    pretrain_batch: PosInt = 64
    pretrain_lr: PosFloat = 3e-3
    # fraction of pre-training answers that are correct; the rest carry the classic
    # "forgot the carry" mistake, so the base model knows the task but prefers a wrong habit
    pretrain_correct_frac: Annotated[float, Meta(ge=0, le=1)] = 0.25
    # scratch task: fraction of pre-training answers that write their working out first
    pretrain_worked_frac: Annotated[float, Meta(ge=0, le=1)] = 0.1
    # scratch task: fraction of worked answers that write everything out a second time, as a
    # check (correct, and redundant: what a self-distillation removes)
    pretrain_redundant_frac: Annotated[float, Meta(ge=0, le=1)] = 0.0
    # drawn uniformly for each pre-training prompt and put before it (e.g. the tier system
    # prompts a later stage gives meaning to), so the base model has seen them, meaning nothing
    pretrain_prompt_prefixes: list[str] = []
    max_position_embeddings: PosInt = 128


class TaskSection(_Section):
    name: str = "arith"  # actor/tasks/ TASKS
    digits: Annotated[int, Meta(ge=1, le=12)] = 2  # arith: operand digits; scratch: most quotient digits
    min_digits: Annotated[int, Meta(ge=1, le=12)] = 1  # scratch: difficulty ranges min_digits..digits
    eval_frac: Annotated[float, Meta(gt=0, lt=1)] = 0.1
    # reasoning-gym: dataset names (reasoning_gym.create_dataset), `size` procedural items each
    datasets: list[str] = []
    size: PosInt = 10000
    # JSONL / parquet with `prompt` and `answer` (optional `id`, `level`/`difficulty`), scored by
    # math-verify; eval_path empty: a hashed eval_frac of `path` is held out
    path: str = ""
    eval_path: str = ""
    instruction: str = ""  # appended to every prompt (e.g. "Put the final answer in \\boxed{}.")
    # the tokenizer's chat template: auto = when the checkpoint has one (tiny built-in models have none)
    chat_template: Literal["auto", "on", "off"] = "auto"
    system_prompt: dict[str, str] = {}  # per tier ("default", "low", "medium", "high"); "" = none
    # per tier: its own response-length limit, at most actor.max_new_tokens (which the rest keep)
    tier_max_new_tokens: dict[str, PosInt] = {}
    # a tier per difficulty (keys: str(Prompt.difficulty)), over the task's own thirds of its
    # levels: the pipeline's tiers by measured pass rate write it (pipeline.py)
    difficulty_tiers: dict[str, str] = {}
    # external scorers run in worker processes; a hung or crashed check scores 0 and is counted
    reward_workers: PosInt = 2
    reward_timeout_s: PosFloat = 10.0


class SGLangSection(_Section):
    """``actor.engine = "sglang"`` (actor/engines/sglang.py): the interpreter of the separate venv
    SGLang is installed in (it pins its own torch), the server's static GPU memory fraction, and
    the deadlines of its start (health check), of one request, and of one weight update."""

    python: str = ""
    mem_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.8
    start_timeout_s: PosFloat = 600.0
    request_timeout_s: PosFloat = 600.0
    update_timeout_s: PosFloat = 300.0


class ActorSection(_Section):
    num_actors: PosInt = 1
    engine: str = "torch"  # actor/engines/ ENGINES: "torch" (embedded) or "sglang" (a server, GPU)
    group_size: Annotated[int, Meta(ge=2)] = 8
    groups_per_batch: PosInt = 16  # prompts decoded together by one engine batch
    max_new_tokens: PosInt = 8
    # continuous batching: sequences decoded at once; a finished one's slot takes the next prompt
    max_batch: PosInt = 256
    # response-length curriculum (actor/curriculum.py): the limit starts at length_start and grows
    # by length_grow up to max_new_tokens, every length_every policy versions ("steps") or when
    # more than length_clip_rate of the last length_window completions hit it ("clip_rate");
    # "off": max_new_tokens throughout
    length_schedule: Literal["off", "steps", "clip_rate"] = "off"
    length_start: PosInt = 8
    length_grow: PosInt = 4
    length_every: PosInt = 20
    length_clip_rate: Annotated[float, Meta(gt=0, le=1)] = 0.2
    length_window: PosInt = 256
    temperature: PosFloat = 1.0
    top_k: NonNegInt = 0  # 0 = off
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    # the engine's numerics: auto = BF16 where the device computes it natively (CUDA, AMX or
    # AVX-512 BF16 CPUs), as an inference engine on a GPU runs, else FP32 (core/precision.py);
    # FP32 attention softmax and LM head either way
    dtype: Dtype = "auto"
    fp32_attn_softmax: bool = True
    threads: PosInt = 1
    # one value for every actor, or a list with one per actor (core/placement.py)
    device: Device | list[Device] = "auto"
    sglang: SGLangSection = msgspec.field(default_factory=lambda: SGLangSection())  # [actor.sglang]


class BufferSection(_Section):
    max_staleness: NonNegInt = 2
    policy: Literal["drop_stale", "oldest_first"] = "drop_stale"
    capacity_groups: PosInt = 1024
    capacity_bytes: PosInt = 256 * 1024 * 1024
    max_frame_bytes: PosInt = 64 * 1024 * 1024
    persist: bool = True
    fsync: Literal["always", "batch", "never"] = "batch"
    segment_bytes: PosInt = 16 * 1024 * 1024
    # a group's prompt may not be longer (and must not be empty); its completions are bounded
    # by actor.max_new_tokens, their number is actor.group_size, their ids by model.vocab_size
    max_prompt_tokens: PosInt = 4096


class LearnerSection(_Section):
    backend: str = "torch"  # learner/backends/ BACKENDS
    groups_per_step: PosInt = 16
    lr: PosFloat = 1e-4
    weight_decay: NonNegFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: NonNegFloat = 1.0  # 0 = off
    loss: str = "ring_zero"  # learner/losses/ LOSSES; eps_high, eps_clip: the parameters each names
    eps_high: PosFloat = 2.0  # Ring-Zero/TIS upper truncation of the ratio
    eps_clip: PosFloat = 0.2  # PPO-clip only
    norm: Literal["token", "sample"] = "token"
    kl_beta: NonNegFloat = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # precision policy: the body's matmuls (auto: as actor.dtype's auto, core/precision.py);
    # master weights, optimiser, the islands below stay FP32
    body_dtype: Dtype = "auto"
    fp32_attn_softmax: bool = True
    fp32_head: bool = True
    logprob_chunk: PosInt = 1024  # tokens per FP32 head chunk
    # gradient accumulation: a step is cut into micro-batches of at most this many padded tokens
    # (whole groups at least one sample each), so memory is bounded by the micro-batch; 0 = one
    micro_batch_tokens: NonNegInt = 8192
    threads: PosInt = 1
    device: Device = "auto"  # model, reference, optimiser state and batches (core/placement.py)
    # tail forensics (learner/tail.py): the k highest- and k lowest-ratio tokens of every step go
    # to run_dir/tail.jsonl, read by `python run.py tail`; 0 = off
    tail_k: NonNegInt = 8
    # start-up contract check: actor-vs-learner scoring of one fixed batch
    # a BF16 engine against a BF16-body learner with both islands: mean |dlogp| 0.058, k3 3.5e-3
    # (bench/precision.py: 32k vocab, peaked random model, 128-token responses); a temperature
    # applied on one side only is far above both bounds
    contract_max_abs_logp_diff: PosFloat = 0.1
    contract_max_kl_k3: PosFloat = 0.01


class WeightSyncSection(_Section):
    # a key of weightsync.PUBLISHERS: shm (default), filesystem (hosts sharing only a file system),
    # nccl (GPUs), cuda_ipc (learner and actors on one shared GPU, weights never through host
    # memory); checked before anything starts by core/placement.py (core imports no weightsync)
    transport: str = "shm"
    bucket_mb: PosInt = 64


class NetSection(_Section):
    host: str = "127.0.0.1"
    buffer_actor_port: NonNegInt = 0  # 0 = pick a free port at launch
    buffer_learner_port: NonNegInt = 0
    # ZeroMQ CURVE keys (z85) -- required when `host` is not loopback. curve_client_public is
    # the servers' allow-list (one key or a list); a client's own public key is derived from its
    # curve_client_secret
    curve_server_public: str = ""
    curve_server_secret: str = ""
    curve_client_public: str | list[str] = ""
    curve_client_secret: str = ""


class RaySection(_Section):
    """The Ray launcher (core/launchers/ray.py): where to run and what each role's Ray actor asks
    for. CPU counts are Ray's logical ones; a local instance is started with exactly enough."""

    address: str = ""  # "" = start a local Ray instance; HOST:PORT or "auto" joins a cluster
    actor_cpus: PosFloat = 1.0
    learner_cpus: PosFloat = 1.0
    buffer_cpus: PosFloat = 1.0
    actor_gpus: NonNegFloat = 0.0
    learner_gpus: NonNegFloat = 0.0
    # custom Ray resources per role (e.g. `ray.actor_resources={node2 = 1}`), to pin roles to
    # the nodes that offer them (`ray start --resources='{"node2": 8}'`)
    actor_resources: dict[str, float] = {}
    learner_resources: dict[str, float] = {}
    buffer_resources: dict[str, float] = {}
    placement_strategy: str = "PACK"  # ray.util.placement_group's: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    start_timeout_s: PosFloat = 120.0  # placement group ready, host actors answering


class MonitorSection(_Section):
    live: Literal["auto", "on", "off"] = "auto"  # auto: rich Live on a TTY, plain lines otherwise
    refresh_s: PosFloat = 1.0
    # plain lines (no terminal): at most one every plain_every_s (an overnight log stays readable);
    # with nothing new, a keep-alive line every 6 x plain_every_s
    plain_every_s: PosFloat = 10.0


class MetricsSection(_Section):
    """Where metrics go besides each role's ``run_dir/metrics/<role>-<id>.jsonl`` and their merge,
    ``run_dir/metrics.jsonl`` (always written; core/metrics.py)."""

    # also TensorBoard event files under run_dir/tensorboard/, same names (extra `tensorboard`)
    tensorboard: bool = False


class ControlSection(_Section):
    """The learner acting on its ratio tail (learner/control.py): an adaptive staleness limit
    and guard-rails checked after forward/backward, before the optimiser step."""

    # adaptive staleness: the limit moves by 1 within [staleness_min, staleness_max], starting at
    # buffer.max_staleness: down when the ratio p99 at the highest lag present is above the
    # target, up while it is below target * (1 - hysteresis), never within dwell_steps of a change
    adaptive_staleness: bool = False
    staleness_min: NonNegInt = 0
    staleness_max: NonNegInt = 8
    # the clean default run (below) at lag 2: ratio p99 median 1.20, max 1.78: a target of 1.5
    # lets the limit climb while the tail stays where Ring-Zero's truncation (eps_high 2) is rare
    ratio_p99_target: PosFloat = 1.5
    hysteresis: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    dwell_steps: NonNegInt = 10
    # guard-rails (0 or null = off), calibrated on two clean runs of the default job (128-wide
    # arith model, BF16 engine and learner body; a shared 2-core EPYC), per-step range:
    # `python run.py run.max_steps=150` (staleness 2; 79 steps before its 480 s budget ran out)
    #   ratio/p99 1.055..1.783 (median 1.20) · ratio/max 1.10..3.07 · ratio/min 0.18..0.90
    #   mismatch/kl_k3 1.5e-4..0.016 · mismatch/abs_logp_diff_p99 0.086..0.99 (all lags)
    # the same with buffer.max_staleness=0 (150 steps, every token at lag 0)
    #   ratio/p99 1.022..1.145 · ratio/max 1.04..2.09 · ratio/min 0.57..0.96 · kl_k3 5e-5..1.4e-3
    #   mismatch/abs_logp_diff_p99_by_staleness/0 0.042..0.232 (median 0.089)
    # each threshold sits well outside: ~1.7x the largest p99, ~3x the largest max, ~9x below
    # the smallest min (2.3x in log space), ~6x the largest k3, ~3x the largest lag-0 |Δ log p|
    guard_ratio_p99: NonNegFloat | None = 3.0
    guard_ratio_max: NonNegFloat | None = 10.0
    guard_ratio_min: NonNegFloat | None = 0.02  # fires at or below: a low tail starves gradients
    guard_kl_k3: NonNegFloat | None = 0.1
    # |Δ log p| p99 of the lag-0 tokens: the engine/learner numerics gap alone (no policy drift)
    guard_abs_logp_diff_p99_s0: NonNegFloat | None = 0.75
    guard_nonfinite: bool = True  # any NaN/inf ratio/* or mismatch/* value
    # warn: log and count · skip_step: drop the batch · pause_actors: no new groups until
    # pause_steps clean steps (or an empty buffer) · rollback: newest checkpoint, fresh version,
    # nothing sampled by the versions since trained
    guard_action: Literal["warn", "skip_step", "pause_actors", "rollback"] = "warn"
    pause_steps: PosInt = 8


class DistillSection(_Section):
    """The pipeline's self-distillation (actor/distill.py, learner/sft.py): the policy samples
    ``samples`` completions for each of ``prompts`` training prompts, the shortest correct one is
    kept, and the *base* model is fine-tuned on that corpus."""

    prompts: PosInt = 2048
    samples: Annotated[int, Meta(ge=2)] = 8
    # optional second pass: the kept completion, then this text, is the prompt of a rewrite that
    # replaces it when still correct and shorter; "" = off
    compress_prompt: str = ""
    lr: PosFloat = 1e-3
    epochs: PosInt = 2
    batch: PosInt = 32


class PipelineSection(_Section):
    """``python run.py pipeline`` (pipeline.py): stages rl1 -> distill -> rl2 -> tiers. Each RL
    stage's table is a partial config over the rest of this file, on top of the recipe's own
    settings for that stage (pipeline.py: RECIPE)."""

    # the tiers stage's partition of prompts: the task's own levels in thirds, or the difficulties
    # ranked by the rl2 model's measured held-out pass rate, in thirds (easiest = low)
    tier_by: Literal["level", "pass_rate"] = "level"
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
    """A bad key or value; the message names its field path (``$.section.key``)."""


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


@functools.cache
def _map_fields() -> frozenset[str]:
    """Paths (``$.task.system_prompt``) of the fields that are maps, not sections: their keys are
    the user's (tiers, stage names), so a new key there is not a typo."""
    out: set[str] = set()
    for sec in msgspec.inspect.type_info(Config).fields:
        out |= {f"$.{sec.name}.{f.name}" for f in sec.type.fields if isinstance(f.type, msgspec.inspect.DictType)}
    return frozenset(out)


def _known(node, key: str, where: str, maps: frozenset[str]) -> bool:
    return isinstance(node, dict) and (key in node or any(where == m or where.startswith(m + ".") for m in maps))


def apply_override(tree: dict, item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict built from the config; unknown paths raise (a map
    field, like ``task.system_prompt``, takes new keys: ``task.system_prompt.low="..."``)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    path, _, raw = item.partition("=")
    keys, maps = path.strip().split("."), _map_fields()
    node = tree
    for depth, k in enumerate(keys[:-1]):
        if not _known(node, k, "$." + ".".join(keys[:depth]), maps):
            raise ConfigError(f"unknown config key `$.{'.'.join(keys[: depth + 1])}`")
        node = node.setdefault(k, {})
    if not _known(node, keys[-1], "$." + ".".join(keys[:-1]), maps):
        raise ConfigError(f"unknown config key `$.{path.strip()}`")
    node[keys[-1]] = _parse_value(raw.strip())


def merge(base: dict, top: dict, where: str = "$", path: str = "$") -> None:
    """Merge the partial config tree ``top`` into ``base`` (the subtree at ``path``) in place;
    an unknown key is named under ``where`` (where ``top`` came from, e.g. ``$.pipeline.rl1``)."""
    for k, v in top.items():
        if not _known(base, k, path, _map_fields()):
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
    """Cross-field rules that per-field types cannot state."""
    if cfg.learner.groups_per_step % cfg.actor.num_actors:
        raise ConfigError(
            "`$.learner.groups_per_step` must be a multiple of `$.actor.num_actors` "
            f"({cfg.learner.groups_per_step} % {cfg.actor.num_actors} != 0): each actor owns an "
            "equal share of the admission quota"
        )
    if cfg.run.max_steps == 0 and cfg.run.max_time_s == 0:
        raise ConfigError("set `$.run.max_steps` or `$.run.max_time_s`: a run needs a budget")
    _validate_lengths(cfg)
    _validate_net(cfg.net)
    _validate_ray(cfg.ray)
    _validate_control(cfg.control, cfg.buffer.max_staleness)


TIERS = ("default", "low", "medium", "high")


def _validate_lengths(cfg: Config) -> None:
    """Tier limits and the curriculum's start within actor.max_new_tokens (what the buffer admits)."""
    cap = cfg.actor.max_new_tokens
    for name, d in (("system_prompt", cfg.task.system_prompt), ("tier_max_new_tokens", cfg.task.tier_max_new_tokens)):
        bad = sorted(set(d) - set(TIERS))
        if bad:
            raise ConfigError(f"`$.task.{name}` has {bad}: tiers are {', '.join(TIERS)}")
    odd = {d: t for d, t in cfg.task.difficulty_tiers.items() if t not in TIERS}
    if odd:
        raise ConfigError(f"`$.task.difficulty_tiers` = {odd}: tiers are {', '.join(TIERS)}")
    over = {t: n for t, n in cfg.task.tier_max_new_tokens.items() if n > cap}
    if over:
        raise ConfigError(f"`$.task.tier_max_new_tokens` = {over} exceeds `$.actor.max_new_tokens` = {cap}")
    if cfg.actor.length_schedule != "off" and cfg.actor.length_start > cap:
        raise ConfigError(f"`$.actor.length_start` = {cfg.actor.length_start} exceeds "
                          f"`$.actor.max_new_tokens` = {cap}")


def _validate_control(c: ControlSection, max_staleness: int) -> None:
    """Bounds that contain the starting limit; ratio thresholds on the side of 1 they guard
    (a ratio p99 or max below 1, or a min above it, would fire on every clean step)."""
    if c.staleness_min > c.staleness_max:
        raise ConfigError(f"`$.control.staleness_max` = {c.staleness_max} is below "
                          f"`$.control.staleness_min` = {c.staleness_min}")
    if c.adaptive_staleness and not c.staleness_min <= max_staleness <= c.staleness_max:
        raise ConfigError(f"`$.buffer.max_staleness` = {max_staleness} (the adaptive limit's start) is outside "
                          f"[`$.control.staleness_min`, `$.control.staleness_max`] = "
                          f"[{c.staleness_min}, {c.staleness_max}]")
    for name in ("guard_ratio_p99", "guard_ratio_max"):
        v = getattr(c, name)
        if v and v <= 1.0:
            raise ConfigError(f"`$.control.{name}` = {v} must be above 1 (or 0 = off)")
    if c.guard_ratio_min and c.guard_ratio_min >= 1.0:
        raise ConfigError(f"`$.control.guard_ratio_min` = {c.guard_ratio_min} must be below 1 (or 0 = off)")


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # ray.util.placement_group's


def _validate_ray(r: RaySection) -> None:
    if r.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"`$.ray.placement_strategy` = {r.placement_strategy!r} is not one of "
                          f"{', '.join(PLACEMENT_STRATEGIES)}")
    for name in ("actor_resources", "learner_resources", "buffer_resources"):
        bad = {k: v for k, v in getattr(r, name).items() if not v > 0 or k in ("CPU", "GPU")}
        if bad:
            raise ConfigError(f"`$.ray.{name}` = {bad}: custom resources need amounts above 0 "
                              "(CPUs and GPUs have their own fields)")


def _validate_net(n: NetSection) -> None:
    """A valid host; off loopback, CURVE with a client allow-list; well-formed keys."""
    try:
        net.check_host(n.host)
    except ValueError as e:
        raise ConfigError(f"`$.net.host`: {e}") from None
    curve = bool(n.curve_server_public or n.curve_server_secret)
    if not net.is_loopback(n.host) and not curve:
        raise ConfigError(
            f"`$.net.host` = {n.host!r} is not loopback: set the CURVE keys "
            "`$.net.curve_server_public/secret` and the client allow-list `$.net.curve_client_public` "
            "(see core/net.py: make_curve_keys)"
        )
    if curve and not (n.curve_server_public and n.curve_server_secret):
        raise ConfigError("CURVE needs both `$.net.curve_server_public` and `$.net.curve_server_secret`")
    if curve and not net.client_keys(n):
        raise ConfigError("CURVE without a client allow-list admits any key pair: set "
                          "`$.net.curve_client_public` (one key or a list)")
    keys = [("curve_server_public", n.curve_server_public), ("curve_server_secret", n.curve_server_secret),
            ("curve_client_secret", n.curve_client_secret)]
    keys += [(f"curve_client_public[{i}]", k) for i, k in enumerate(net.client_keys(n))]
    for name, key in keys:
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
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {toml_path}: {e}") from None
    for item in overrides:
        apply_override(tree, item)
    return from_dict(tree)


def to_json(cfg: Config) -> bytes:
    return msgspec.json.format(msgspec.json.encode(cfg), indent=2)


def from_json(data: bytes) -> Config:
    return from_dict(msgspec.json.decode(data))
