"""The one wire schema: frozen, tagged, ``array_like`` msgspec Structs, a typed decoder per socket.
Fields are append-only within ``SCHEMA_VERSION`` (checked in ``Hello``, carried by every group). A
group's decoder refuses arrays over the run's :class:`Limits` before allocating them. Per-token
arrays travel as raw little-endian bytes: decoding 8k Python floats costs ~50x a bytes copy.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Annotated, Any, NamedTuple, Union

import msgspec
import numpy as np
from msgspec import Meta

SCHEMA_VERSION = 6  # 6: a completion may hold environment tokens (Completion.mask); 5: 1..64 groups a message
MAX_GROUPS_PER_MSG = 64

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
# the fast path compares byte lengths as element counts
assert TOKEN_DTYPE.itemsize == LOGPROB_DTYPE.itemsize == VERSION_DTYPE.itemsize
_FINISH_REASONS = ("stop", "length")
_MAX_LOGPROB = 1e-4  # float32 rounding may push log(1) a hair above 0; anything more is a bug
_MIN_LOGPROB = -1e4  # a sampled token's is above ~-100 in float32; far below is no probability
MAX_ABS_REWARD = 1e6  # beyond it a reward is a scorer's bug: its square would overflow float32
MAX_TEXT_CHARS = 256  # group_id, task, tier, finish_reason


class _Msg(msgspec.Struct, frozen=True, array_like=True, tag=True, omit_defaults=False):
    """Base of every tagged wire message."""


class Hello(_Msg, tag="hello"):
    role: str
    id: str
    schema_version: int = SCHEMA_VERSION
    token: str = ""  # the run's secret (core.net.run_secret): a socket is trusted only after a Hello with it
    # learner only: its weights' step and version; the buffer serves again the groups trained since (ARCHITECTURE.md)
    step: int = -1
    version: int = -1


class Shutdown(_Msg, tag="shutdown"):
    reason: str = ""


class Completion(msgspec.Struct, frozen=True, array_like=True):
    # per-token arrays, equal lengths: sampled ids, behaviour log-probs of the distribution
    # actually sampled from (after temperature), and the policy version that produced each token
    tokens: bytes
    logprobs: bytes
    versions: bytes
    finish_reason: str  # "stop" (EOS sampled) or "length" (hit max_new_tokens)
    reward: float
    # an episode's (actor/episodes.py): per token 1 sampled, 0 the environment's (log-prob 0, the version of the
    # sampled token before it; no loss, no ratio); empty: every token sampled
    mask: bytes = b""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_DTYPE.itemsize

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype=TOKEN_DTYPE)

    def logprob_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype=LOGPROB_DTYPE)

    def version_array(self) -> np.ndarray:
        return np.frombuffer(self.versions, dtype=VERSION_DTYPE)

    def sampled(self) -> np.ndarray:
        """Per token, whether the engine sampled it (False: the environment's)."""
        return np.frombuffer(self.mask, dtype=MASK_DTYPE) == 1 if self.mask else np.ones(self.num_tokens, bool)


def staleness(learner_version: int, oldest_version):
    """The one definition of staleness (ARCHITECTURE.md: Versions and staleness), of ints or arrays."""
    return learner_version - oldest_version


class RolloutGroup(_Msg, tag="group"):
    actor_id: str
    seq: int  # (actor_id, seq): the exactly-once identity, unique per run; seq counts from 0 per actor
    group_id: str
    task: str
    tier: str
    prompt_tokens: bytes
    completions: list[Completion]  # G completions of the same prompt
    start_version: int  # the policy version when the group was admitted (its first token's)
    created_at: float
    schema_version: int = SCHEMA_VERSION

    @property
    def key(self) -> tuple[str, int]:
        return (self.actor_id, self.seq)

    def _versions(self) -> np.ndarray:
        # one array over all completions: ~5x cheaper than a reduction per completion
        versions = b"".join([c.versions for c in self.completions])
        return np.frombuffer(versions, VERSION_DTYPE, len(versions) // VERSION_DTYPE.itemsize)

    def length(self) -> int:
        """Tokens of the longest completion (the response-length bucket's measure)."""
        return max([len(c.tokens) for c in self.completions], default=0) // TOKEN_DTYPE.itemsize

    def min_version(self) -> int:
        """Oldest policy version among the tokens (the staleness anchor); the start version without any."""
        v = self._versions()
        return int(v.min()) if v.size else self.start_version

    def nbytes(self) -> int:
        return len(self.prompt_tokens) + sum(len(c.tokens) + len(c.logprobs) + len(c.versions)
                                             for c in self.completions)


class Ack(_Msg, tag="ack"):
    actor_id: str
    seq: int
    # "ok": accepted (durable if persisted) · "duplicate": accepted earlier · "busy": buffer full, or
    # newer than any learner version known yet: resend later · "rejected": invalid or stale, never
    # resend · "dropped": accepted, since discarded as stale · "hello": answer to Hello, ``seq`` is the
    # next unused seq · "unauthenticated": no Hello with the run's secret on this connection yet
    status: str
    reason: str = ""


class Acks(_Msg, tag="acks"):
    acks: list[Ack]  # one actor's acks of one group commit, in order


class InFlight(_Msg, tag="in_flight"):
    oldest: int  # on change: start version of the actor's oldest group in generation (-1: none); stale_strategy=wait


class Control(_Msg, tag="control"):
    # the learner's control state, passed on by the buffer to the actors (when: ARCHITECTURE.md, "Versions
    # and staleness"): the staleness limit admission follows and whether new groups may start
    max_staleness: int
    pause: bool


class SampleRequest(_Msg, tag="sample_req"):
    request_id: int
    num_groups: int
    learner_version: int
    max_staleness: int = -1  # control.adaptive_staleness: the buffer's and (via Control) actors' limit; -1: unchanged
    pause_actors: bool = False  # guard_action = pause_actors: the actors start no new group while set
    covered_step: int = -1  # newest step a fallback checkpoint holds (-1: none): the buffer forgets groups up to it


class SampleBatch(_Msg, tag="sample_batch"):
    request_id: int
    groups: list[RolloutGroup]
    depth: int = 0  # the buffer's when the batch was cut, for the dashboard


class Consumed(_Msg, tag="consumed"):
    # learner -> buffer: these groups were trained on (after the optimiser step)
    keys: list[tuple[str, int]]
    learner_version: int
    step: int = -1  # the step that trained them (kept until covered); -1: never trained, forget them


class Bucket(msgspec.Struct, frozen=True, array_like=True):
    dtype: str  # one flat buffer of a single dtype, its tensors back to back at ``offsets`` (bytes)
    names: list[str]
    offsets: list[int]
    nbytes: int


class WeightUpdateHeader(_Msg, tag="weights"):
    version: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    buckets: list[Bucket]


# the weight transports' file headers and frames (weightsync/)
class FileHeader(_Msg, tag="ws_file"):
    layout: WeightUpdateHeader  # version -1
    payload_at: int  # where the payload starts: a multiple of PAGE
    file_bytes: int
    epoch: str = ""  # the publisher's (weightsync/delta.py): which deltas may follow this full version


class DeltaHeader(_Msg, tag="ws_delta"):
    # a version as the elements that changed (weightsync/delta.py): a delta file's header, an nccl frame
    version: int
    base: int  # the version it applies to
    full: int  # the full version its chain of deltas starts from
    epoch: str  # the publisher's: a reader holding another publisher's weights reads the full version
    counts: list[int]  # changed elements per tensor, in layout order


class IpcSlot(_Msg, tag="ws_ipc"):
    # one device slot, as a reader opens it; the handle fields are ``_share_cuda_()``'s
    slot: int
    device: int
    handle: bytes | None
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    layout: WeightUpdateHeader  # version -1


class RankDevice(_Msg, tag="ws_device"):
    # subscriber -> publisher, after its Hello: where its rank computes
    host: str
    device: str  # "cpu" | "cuda:N"


class CollectiveInit(_Msg, tag="ws_init"):
    # publisher -> one subscriber, once: its place in the communicator
    rank: int
    world_size: int
    backend: str  # BACKENDS
    unique_id: bytes  # NCCL unique id (128 B), else b"host:port" of the Gloo / torch.distributed store
    layout: WeightUpdateHeader  # version -1


# the reward pool's frames on its workers' pipes (actor/rewards.py): untagged, one type per direction
class ScoreRequest(msgspec.Struct, array_like=True):
    id: int
    payload: Any


class ScoreReply(msgspec.Struct, array_like=True):
    id: int
    score: float = 0.0
    error: str = ""
    text: str | None = None  # a tool's result (actor/episodes.py)


# metrics travel on no socket: JSON lines in run_dir/metrics/ (core/metrics.py)
class MetricRecords(_Msg, tag="metrics"):
    role: str
    id: str
    step: int
    time: float
    values: dict[str, float | list[float]]


ACTOR_TO_BUFFER = Union[Hello, InFlight, RolloutGroup]
BUFFER_TO_ACTOR = Union[Ack, Acks, Control]
LEARNER_TO_BUFFER = Union[Hello, SampleRequest, Consumed]
BUFFER_TO_LEARNER = Union[SampleBatch, Ack]  # Ack: "unauthenticated", or "rejected" for a Hello

encode = msgspec.msgpack.Encoder().encode
decoder = msgspec.msgpack.Decoder  # decoder(kind): a typed decoder for one socket (a message class or a Union)


class Limits(NamedTuple):
    """What one RolloutGroup of a run may hold (0: not checked, as for a tool without a config)."""

    group_size: int = 0  # exactly this many completions
    max_prompt_tokens: int = 0
    max_new_tokens: int = 0  # tokens of one completion
    vocab_size: int = 0  # token ids in [0, vocab_size)
    context: int = 0  # the model's: prompt + completion within it

    @classmethod
    def of(cls, cfg) -> Limits:
        return cls(cfg.actor.group_size, cfg.buffer.max_prompt_tokens, cfg.actor.max_new_tokens,
                   cfg.model.vocab_size, cfg.model.context)


NO_LIMITS = Limits()


def _cap(items: int) -> Meta:
    return Meta(max_length=items) if items else Meta()


@lru_cache(maxsize=16)
def bounded_group(limits: Limits) -> type:
    """RolloutGroup with array lengths bounded by ``limits``: its decoder refuses a frame at the first
    array header above them, before allocating (two million empty completions cost nothing)."""
    item, text = TOKEN_DTYPE.itemsize, Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
    tok, mask = Annotated[bytes, _cap(limits.max_new_tokens * item)], Annotated[bytes, _cap(limits.max_new_tokens)]
    fields = [("tokens", tok), ("logprobs", tok), ("versions", tok), ("finish_reason", text), ("mask", mask)]
    comp = msgspec.defstruct("Completion", fields, bases=(Completion,), module=__name__)
    fields = [("group_id", text), ("task", text), ("tier", text),
              ("prompt_tokens", Annotated[bytes, _cap(limits.max_prompt_tokens * item)]),
              ("completions", Annotated[list[comp], _cap(limits.group_size)])]
    return msgspec.defstruct("RolloutGroup", fields, bases=(RolloutGroup,), tag="group", module=__name__)


def group_decoder(limits: Limits, *others) -> msgspec.msgpack.Decoder:
    return decoder(Union[(*others, bounded_group(limits))])


class _GroupHead(msgspec.Struct, array_like=True):
    # the first fields of an encoded RolloutGroup; decoding skips the rest without building it
    tag: str
    actor_id: str
    seq: int


_head = msgspec.msgpack.Decoder(_GroupHead)


def group_key(frame) -> tuple[str, int] | None:
    """``(actor_id, seq)`` of an encoded RolloutGroup without decoding its arrays; None if it is not one."""
    try:
        head = _head.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return (head.actor_id, head.seq) if head.tag == "group" else None


def decode_reason(e: Exception) -> str:
    """The counter key of a frame a typed decoder refused."""
    if isinstance(e, msgspec.ValidationError):
        return "over_limit" if "of length <=" in str(e) else "bad_fields"
    return "decode_error"


class InvalidMessage(ValueError):
    """A message decoded cleanly but violates an invariant; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def validate_group(g: RolloutGroup, limits: Limits = NO_LIMITS) -> tuple[int, int]:
    """What a typed decoder cannot check, against ``limits``: raises InvalidMessage, returns the group's
    (min_version, max_version). A prompt is required (the learner predicts the first token from its last)."""
    verdict = validate_groups([g], limits)[0]
    if isinstance(verdict, InvalidMessage):
        raise verdict
    return verdict


def validate_groups(groups: list[RolloutGroup], limits: Limits = NO_LIMITS) -> list:
    """:func:`validate_group` of each group, in order: its (min_version, max_version) or the
    InvalidMessage it raises. Valid groups cost one numpy pass over all their arrays joined (~1 us a
    group of the default job's size where one pass per group costs ~8, 16 groups to a message); only
    when one fails is each group checked alone, and a failing one completion by completion, for the
    exact reason."""
    versions = _groups_pass(groups, limits)
    return versions if versions is not None else [_explain(g, limits) for g in groups]


def _explain(g: RolloutGroup, limits: Limits) -> tuple[int, int] | InvalidMessage:
    try:
        versions = _groups_pass([g], limits)
        if versions is None:  # the first failing check raises its reason
            _check_head(g, limits)
            _explain_completions(g, limits)
            raise AssertionError("fast path and reference checks disagree")  # unreachable
        return versions[0]
    except InvalidMessage as e:
        return e


def _check_head(g: RolloutGroup, limits: Limits) -> None:
    """The group's own fields and its prompt (raises InvalidMessage)."""
    if g.schema_version != SCHEMA_VERSION:
        raise InvalidMessage("schema_version", f"got {g.schema_version}, want {SCHEMA_VERSION}")
    if not g.completions:
        raise InvalidMessage("empty_group")
    if g.seq < 0 or g.start_version < 0:
        raise InvalidMessage("negative_id")
    if not math.isfinite(g.created_at):
        raise InvalidMessage("bad_timestamp")
    if len(g.prompt_tokens) % TOKEN_DTYPE.itemsize:
        raise InvalidMessage("ragged_bytes", "prompt_tokens")
    n, prompt = len(g.completions), len(g.prompt_tokens) // TOKEN_DTYPE.itemsize
    if limits.group_size and n != limits.group_size:
        raise InvalidMessage("group_size", f"{n} completions, want {limits.group_size}")
    if not prompt:
        raise InvalidMessage("empty_prompt")
    if limits.max_prompt_tokens and prompt > limits.max_prompt_tokens:
        raise InvalidMessage("prompt_too_long", f"{prompt} > {limits.max_prompt_tokens} tokens")
    if limits.context and prompt >= limits.context:
        raise InvalidMessage("over_context", f"a prompt of {prompt} tokens, context {limits.context}")


def _ids_ok(ids: np.ndarray, vocab_size: int) -> bool:
    return not ids.size or (ids.min() >= 0 and (not vocab_size or ids.max() < vocab_size))


def _shapes_ok(g: RolloutGroup, limits: Limits) -> bool:
    """The checks of :func:`_explain_completions` that need no array, on every completion."""
    item = TOKEN_DTYPE.itemsize
    cap = min(limits.max_new_tokens or math.inf, limits.context - len(g.prompt_tokens) // item if limits.context
              else math.inf) * item
    for c in g.completions:
        n = len(c.tokens)
        if n % item or n > cap or len(c.logprobs) != n or len(c.versions) != n \
                or c.finish_reason not in _FINISH_REASONS or not abs(c.reward) <= MAX_ABS_REWARD \
                or (c.mask and not _mask_ok(c)):
            return False
    return True


def _groups_pass(groups: list[RolloutGroup], limits: Limits) -> list[tuple[int, int]] | None:
    """Each group's (min_version, max_version) if every check passes for all of them, else None."""
    try:
        for g in groups:
            _check_head(g, limits)
    except InvalidMessage:
        return None
    if not all(_shapes_ok(g, limits) for g in groups):
        return None
    comps = [c for g in groups for c in g.completions]
    ids = np.frombuffer(b"".join([*[g.prompt_tokens for g in groups], *[c.tokens for c in comps]]), TOKEN_DTYPE)
    lp = np.frombuffer(b"".join([c.logprobs for c in comps]), dtype=LOGPROB_DTYPE)
    if not _ids_ok(ids, limits.vocab_size):
        return None
    # max() propagates NaN and NaN <= x is False: one test rejects NaN, +inf and positives; min() -inf
    if lp.size and not (lp.max() <= _MAX_LOGPROB and lp.min() >= _MIN_LOGPROB):
        return None
    out = [(g.start_version, g.start_version) for g in groups]  # a group without a token
    sizes = np.array([sum(len(c.versions) for c in g.completions) for g in groups]) // VERSION_DTYPE.itemsize
    held = np.flatnonzero(sizes)
    if held.size:  # each group's oldest and newest version: one reduction each over every group's tokens
        v = np.frombuffer(b"".join([c.versions for c in comps]), VERSION_DTYPE)
        starts = (np.cumsum(sizes) - sizes)[held]
        oldest, newest = np.minimum.reduceat(v, starts), np.maximum.reduceat(v, starts)
        if oldest.min() < 0:
            return None
        for i, lo, hi in zip(held.tolist(), oldest.tolist(), newest.tolist()):
            out[i] = (lo, max(hi, groups[i].start_version))
    return out


def _mask_ok(c: Completion) -> bool:
    """One flag (0/1) per token; an environment token has log-prob 0 and follows a sampled one."""
    m = np.frombuffer(c.mask, dtype=MASK_DTYPE)
    return m.size == c.num_tokens and m.size > 0 and m[0] == 1 and bool((m <= 1).all()) \
        and not c.logprob_array()[m == 0].any()


def _explain_completions(g: RolloutGroup, limits: Limits) -> None:
    """The reference checks, completion by completion: raises the first failure's reason."""
    if not _ids_ok(np.frombuffer(g.prompt_tokens, dtype=TOKEN_DTYPE), limits.vocab_size):
        raise InvalidMessage("token_out_of_vocab", f"prompt, vocabulary {limits.vocab_size or '?'}")
    for i, c in enumerate(g.completions):
        sizes = [len(c.tokens), len(c.logprobs), len(c.versions)]
        if any(n % TOKEN_DTYPE.itemsize for n in sizes):  # (the three dtypes are equally wide)
            raise InvalidMessage("ragged_bytes", f"completion {i}")
        n_tok, n_lp, n_ver = (n // TOKEN_DTYPE.itemsize for n in sizes)
        if not (n_tok == n_lp == n_ver):
            raise InvalidMessage("length_mismatch", f"completion {i}: {n_tok}/{n_lp}/{n_ver}")
        if limits.max_new_tokens and n_tok > limits.max_new_tokens:
            raise InvalidMessage("completion_too_long", f"completion {i}: {n_tok} > {limits.max_new_tokens}")
        prompt = len(g.prompt_tokens) // TOKEN_DTYPE.itemsize
        if limits.context and prompt + n_tok > limits.context:
            raise InvalidMessage("over_context", f"completion {i}: {prompt} + {n_tok} > {limits.context}")
        if not math.isfinite(c.reward):
            raise InvalidMessage("nonfinite_reward", f"completion {i}")
        if abs(c.reward) > MAX_ABS_REWARD:
            raise InvalidMessage("reward_out_of_range", f"completion {i}: {c.reward:g}")
        lp = c.logprob_array()
        if not np.isfinite(lp).all():
            raise InvalidMessage("nonfinite_logprob", f"completion {i}")
        if (lp > _MAX_LOGPROB).any():
            raise InvalidMessage("positive_logprob", f"completion {i}")
        if (lp < _MIN_LOGPROB).any():
            raise InvalidMessage("logprob_out_of_range", f"completion {i}: {lp.min():g}")
        if (c.version_array() < 0).any():
            raise InvalidMessage("negative_version", f"completion {i}")
        if not _ids_ok(c.token_array(), limits.vocab_size):
            raise InvalidMessage("token_out_of_vocab", f"completion {i}, vocabulary {limits.vocab_size or '?'}")
        if c.finish_reason not in _FINISH_REASONS:
            raise InvalidMessage("finish_reason", repr(c.finish_reason)[:32])
        if c.mask and not _mask_ok(c):
            raise InvalidMessage("bad_mask", f"completion {i}")


def make_completion(tokens, logprobs, versions, finish_reason: str, reward: float, mask=None) -> Completion:
    """A Completion from array-likes, in the wire dtypes; ``mask`` None: every token sampled."""
    return Completion(np.asarray(tokens, TOKEN_DTYPE).tobytes(), np.asarray(logprobs, LOGPROB_DTYPE).tobytes(),
                      np.asarray(versions, VERSION_DTYPE).tobytes(), finish_reason, float(reward),
                      b"" if mask is None else np.asarray(mask, MASK_DTYPE).tobytes())


def group_from_samples(samples, rewards, *, actor_id: str, seq: int, group_id: str, task: str, tier: str,
                       prompt, start_version: int, created_at: float = 0.0) -> RolloutGroup:
    """The one way a prompt and its G engine samples (objects with ``tokens``, ``logprobs``,
    ``versions``, ``finish_reason``) become a RolloutGroup; ``rewards`` are one per sample."""
    comps = [make_completion(s.tokens, s.logprobs, s.versions, s.finish_reason, r, getattr(s, "mask", None))
             for s, r in zip(samples, rewards)]
    return RolloutGroup(actor_id=actor_id, seq=seq, group_id=group_id, task=task, tier=tier,
                        prompt_tokens=np.asarray(prompt, dtype=TOKEN_DTYPE).tobytes(), completions=comps,
                        start_version=start_version, created_at=created_at)
