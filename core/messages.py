"""The one wire schema of driftrl (ARCHITECTURE.md: Dataflow).

Every message is a frozen, tagged, ``array_like`` msgspec Struct. Each socket decodes with one
typed decoder built by :func:`decoder` for exactly the messages it may receive, so a malformed
frame raises ``msgspec.ValidationError``/``DecodeError`` at the socket and never reaches training.

Fields are append-only within a schema version: new fields go at the end with a default; removing
or retyping one bumps ``SCHEMA_VERSION``, which is checked in the ``Hello`` handshake and carried
by every ``RolloutGroup`` (2: the by-reference fields of ``SampleRequest``/``SampleBatch`` went;
3: ``Hello`` carries the run's secret, the buffer answers unauthenticated peers with an ``Ack``).

A group is checked twice against the run's :class:`Limits`: the socket's decoder
(:func:`group_decoder`) refuses a frame whose completions list or byte arrays exceed them before
it allocates anything (a 40 MB frame of two million empty completions is refused at its array
header, not after building two million objects), and :func:`validate_group` checks what a type
cannot: token ids in the vocabulary, exactly ``group_size`` completions, finite values.

Per-token arrays travel as raw little-endian bytes (``tokens``/``versions`` int32,
``logprobs`` float32): decoding a list of 8k Python floats costs ~50x more than a bytes copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Union

import msgspec
import numpy as np
from msgspec import Meta

SCHEMA_VERSION = 3

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i4")


class _Msg(msgspec.Struct, frozen=True, array_like=True, tag=True, omit_defaults=False):
    """Base of every tagged wire message: frozen, encoded as an array, tag = class kwarg."""


# ---- handshake / liveness -------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    role: str
    id: str
    schema_version: int = SCHEMA_VERSION
    # the run's secret (core.net.run_secret): the buffer trusts a socket only after a Hello with it
    token: str = ""
    # learner only: the step and version of the weights it holds; the buffer serves again the groups
    # trained after that step (a restarted learner lost them), except those whose every token is newer
    step: int = -1
    version: int = -1


class Shutdown(_Msg, tag="shutdown"):
    reason: str = ""


# ---- trajectories ---------------------------------------------------------------------------


class Completion(msgspec.Struct, frozen=True, array_like=True):
    # per-token arrays, equal lengths: sampled ids, behaviour log-probs of the distribution
    # actually sampled from (after temperature), and the policy version that produced each token
    tokens: bytes
    logprobs: bytes
    versions: bytes
    # "stop" (EOS sampled) or "length" (hit max_new_tokens)
    finish_reason: str
    reward: float

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_DTYPE.itemsize

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype=TOKEN_DTYPE)

    def logprob_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype=LOGPROB_DTYPE)

    def version_array(self) -> np.ndarray:
        return np.frombuffer(self.versions, dtype=VERSION_DTYPE)


class RolloutGroup(_Msg, tag="group"):
    # exactly-once identity: (actor_id, seq) is unique per run; seq counts from 0 per actor
    actor_id: str
    seq: int
    # what was asked
    group_id: str
    task: str
    tier: str
    prompt_tokens: bytes
    # G completions of the same prompt
    completions: list[Completion]
    # policy version when the group was admitted (its first token's version)
    start_version: int
    created_at: float
    schema_version: int = SCHEMA_VERSION

    @property
    def key(self) -> tuple[str, int]:
        return (self.actor_id, self.seq)

    def min_version(self) -> int:
        """Oldest policy version among the group's tokens (the staleness anchor, ARCHITECTURE.md: Versions and staleness); the
        start version when no completion has a token. One numpy reduction over all completions'
        versions joined: ~5x cheaper than one per completion (4 us instead of 21 for 8 x 1,024)."""
        versions = b"".join([c.versions for c in self.completions])
        n = len(versions) // VERSION_DTYPE.itemsize
        return int(np.frombuffer(versions, VERSION_DTYPE, n).min()) if n else self.start_version

    def max_version(self) -> int:
        """Newest policy version among the group's tokens, or its start version if newer."""
        versions = b"".join([c.versions for c in self.completions])
        n = len(versions) // VERSION_DTYPE.itemsize
        newest = int(np.frombuffer(versions, VERSION_DTYPE, n).max()) if n else self.start_version
        return max(newest, self.start_version)

    def nbytes(self) -> int:
        return len(self.prompt_tokens) + sum(
            len(c.tokens) + len(c.logprobs) + len(c.versions) for c in self.completions
        )


class Ack(_Msg, tag="ack"):
    actor_id: str
    seq: int
    # "ok": accepted (durable if persistence is on) · "duplicate": already accepted earlier ·
    # "busy": buffer full, or the group is newer than any learner version it knows of yet: resend
    # later · "rejected": invalid or stale, never resend ·
    # "dropped": accepted earlier, since discarded as stale · "hello": answer to Hello, ``seq`` is
    # the actor's next unused seq · "unauthenticated": this connection has not presented the run's
    # secret in a Hello (yet, or since the buffer restarted): send one, then resend
    status: str
    reason: str = ""


class Acks(_Msg, tag="acks"):
    # several acks for one actor, in order: what became durable in one group commit leaves as
    # one message (a ZeroMQ send costs more than encoding a few more acks)
    acks: list[Ack]
    # the learner's control state, passed on by the buffer (learner/control.py): the staleness
    # limit the actor's admission follows (-1: unchanged) and whether it may start new groups.
    # Once the limit or the pause differ from the run's config, every message to an actor is an
    # Acks carrying them, and a change is sent at once to every actor (``acks`` may be empty)
    max_staleness: int = -1
    pause: bool = False


class SampleRequest(_Msg, tag="sample_req"):
    request_id: int
    num_groups: int
    learner_version: int
    # the learner's current staleness limit (control.adaptive_staleness), which the buffer's
    # store and, through Acks, the actors' admission follow; -1: unchanged
    max_staleness: int = -1
    # guard_action = pause_actors: the actors start no new group while set
    pause_actors: bool = False
    # every step up to this one is in a checkpoint a fallback could still load: the buffer forgets
    # the groups trained by then (-1: none yet)
    covered_step: int = -1


class SampleBatch(_Msg, tag="sample_batch"):
    request_id: int
    groups: list[RolloutGroup]
    # buffer state when the batch was cut, for the dashboard
    depth: int = 0


class Consumed(_Msg, tag="consumed"):
    # learner -> buffer: these groups were trained on (after the optimiser step)
    keys: list[tuple[str, int]]
    learner_version: int
    step: int = -1  # the step that trained them (kept until covered); -1: never trained, forget them


# ---- weights ----------------------------------------------------------------------------------


class Bucket(msgspec.Struct, frozen=True, array_like=True):
    # one flat buffer of a single dtype; tensors laid out back to back at these byte offsets
    dtype: str
    names: list[str]
    offsets: list[int]
    nbytes: int


class WeightUpdateHeader(_Msg, tag="weights"):
    version: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    buckets: list[Bucket]


# ---- metrics: JSON lines in run_dir/metrics/ (core/metrics.py), on no socket ------------------

MetricValue = Union[float, list[float]]


class MetricRecords(_Msg, tag="metrics"):
    role: str
    id: str
    step: int
    time: float
    values: dict[str, MetricValue]


# ---- socket codecs ----------------------------------------------------------------------------

ACTOR_TO_BUFFER = Union[Hello, RolloutGroup]
BUFFER_TO_ACTOR = Union[Ack, Acks]
LEARNER_TO_BUFFER = Union[Hello, SampleRequest, Consumed]
BUFFER_TO_LEARNER = Union[SampleBatch, Ack]  # Ack: "unauthenticated", or "rejected" for a Hello

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decoder(kind) -> msgspec.msgpack.Decoder:
    """A typed decoder for one socket; ``kind`` is a message class or a Union of them."""
    return msgspec.msgpack.Decoder(kind)


@dataclass(frozen=True)
class Limits:
    """What one RolloutGroup of a run may hold (0: not checked, as for a tool without a config)."""

    group_size: int = 0  # exactly this many completions
    max_prompt_tokens: int = 0
    max_new_tokens: int = 0  # tokens of one completion
    vocab_size: int = 0  # token ids in [0, vocab_size)

    @classmethod
    def of(cls, cfg) -> Limits:
        """The limits a run's config sets: ``actor.group_size`` / ``max_new_tokens``,
        ``buffer.max_prompt_tokens``, ``model.vocab_size``."""
        return cls(cfg.actor.group_size, cfg.buffer.max_prompt_tokens, cfg.actor.max_new_tokens,
                   cfg.model.vocab_size)


NO_LIMITS = Limits()


def _cap(items: int) -> Meta:
    return Meta(max_length=items) if items else Meta()


@lru_cache(maxsize=16)
def bounded_group(limits: Limits) -> type:
    """A RolloutGroup subclass whose array lengths are bounded by ``limits``: its decoder refuses a
    frame at the first array header above them, before allocating the elements."""
    tok, item = Annotated[bytes, _cap(limits.max_new_tokens * TOKEN_DTYPE.itemsize)], TOKEN_DTYPE.itemsize
    comp = msgspec.defstruct("Completion", [("tokens", tok), ("logprobs", tok), ("versions", tok)],
                             bases=(Completion,), module=__name__)
    return msgspec.defstruct(
        "RolloutGroup", [("prompt_tokens", Annotated[bytes, _cap(limits.max_prompt_tokens * item)]),
                         ("completions", Annotated[list[comp], _cap(limits.group_size)])],
        bases=(RolloutGroup,), tag="group", module=__name__)


def group_decoder(limits: Limits, *others) -> msgspec.msgpack.Decoder:
    """The decoder of a socket that receives RolloutGroups within ``limits`` (and ``others``)."""
    return decoder(Union[(*others, bounded_group(limits))] if others else bounded_group(limits))


class _GroupHead(msgspec.Struct, array_like=True):
    # the first fields of an encoded RolloutGroup; decoding skips the rest without building it
    tag: str
    actor_id: str
    seq: int


_head = msgspec.msgpack.Decoder(_GroupHead)


def group_key(frame) -> tuple[str, int] | None:
    """``(actor_id, seq)`` of an encoded RolloutGroup, read without decoding its arrays (the rest
    of the frame is skipped, nothing is allocated for it); None if the frame does not start like
    one."""
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


_FINISH_REASONS = ("stop", "length")
_MAX_LOGPROB = 1e-4  # float32 rounding may push log(1) a hair above 0; anything more is a bug
# the fast path compares byte lengths, which equals comparing element counts only while the
# three per-token dtypes have one item size
assert TOKEN_DTYPE.itemsize == LOGPROB_DTYPE.itemsize == VERSION_DTYPE.itemsize


def validate_group(g: RolloutGroup, limits: Limits = NO_LIMITS) -> int:
    """Semantic checks a typed decoder cannot express, against the run's ``limits``. Raises
    InvalidMessage; returns the group's :meth:`RolloutGroup.min_version` (computed on the way, the
    buffer needs it). A non-empty prompt is required whatever the limits: the learner predicts
    the first completion token from the last prompt token.

    The common case (a valid group) is checked in one pass: scalar checks per completion, then
    one numpy reduction over all completions' arrays joined (~6 us for 8 x 1,024 tokens instead
    of ~40 us per-completion). Only when that pass fails does the per-completion loop run, to
    raise the first failing reason exactly as it always has.
    """
    if g.schema_version != SCHEMA_VERSION:
        raise InvalidMessage("schema_version", f"got {g.schema_version}, want {SCHEMA_VERSION}")
    if not g.completions:
        raise InvalidMessage("empty_group")
    if g.seq < 0 or g.start_version < 0:
        raise InvalidMessage("negative_id")
    if len(g.prompt_tokens) % TOKEN_DTYPE.itemsize:
        raise InvalidMessage("ragged_bytes", "prompt_tokens")
    _check_shape(g, limits)
    min_version = _completions_pass(g, limits)
    if min_version is None:
        _explain_completions(g, limits)
        raise AssertionError("fast path and reference checks disagree")  # unreachable
    return min_version


def _check_shape(g: RolloutGroup, limits: Limits) -> None:
    n, prompt = len(g.completions), len(g.prompt_tokens) // TOKEN_DTYPE.itemsize
    if limits.group_size and n != limits.group_size:
        raise InvalidMessage("group_size", f"{n} completions, want {limits.group_size}")
    if not prompt:
        raise InvalidMessage("empty_prompt")
    if limits.max_prompt_tokens and prompt > limits.max_prompt_tokens:
        raise InvalidMessage("prompt_too_long", f"{prompt} > {limits.max_prompt_tokens} tokens")


def _ids_ok(ids: np.ndarray, vocab_size: int) -> bool:
    return not ids.size or (ids.min() >= 0 and (not vocab_size or ids.max() < vocab_size))


def _completions_pass(g: RolloutGroup, limits: Limits) -> int | None:
    """None unless every per-completion check of :func:`_explain_completions` would pass; then
    the group's min_version."""
    item = TOKEN_DTYPE.itemsize
    cap = limits.max_new_tokens * item or math.inf
    comps = g.completions
    for c in comps:
        n = len(c.tokens)
        if n % item or n > cap or len(c.logprobs) != n or len(c.versions) != n \
                or c.finish_reason not in _FINISH_REASONS or not math.isfinite(c.reward):
            return None
    ids = np.frombuffer(b"".join([g.prompt_tokens, *[c.tokens for c in comps]]), dtype=TOKEN_DTYPE)
    if not _ids_ok(ids, limits.vocab_size):
        return None
    lp = np.frombuffer(b"".join([c.logprobs for c in comps]), dtype=LOGPROB_DTYPE)
    if not lp.size:
        return g.start_version
    # max() propagates NaN and NaN <= x is False, so one comparison rejects NaN and positives;
    # +inf is caught by the same test, -inf by min()
    if not (lp.max() <= _MAX_LOGPROB and lp.min() > -math.inf):
        return None
    oldest = g.min_version()
    return oldest if oldest >= 0 else None


def _explain_completions(g: RolloutGroup, limits: Limits) -> None:
    """The reference checks, completion by completion: raises the first failure's reason."""
    if not _ids_ok(np.frombuffer(g.prompt_tokens, dtype=TOKEN_DTYPE), limits.vocab_size):
        raise InvalidMessage("token_out_of_vocab", f"prompt, vocabulary {limits.vocab_size or '?'}")
    for i, c in enumerate(g.completions):
        n_tok, r1 = divmod(len(c.tokens), TOKEN_DTYPE.itemsize)
        n_lp, r2 = divmod(len(c.logprobs), LOGPROB_DTYPE.itemsize)
        n_ver, r3 = divmod(len(c.versions), VERSION_DTYPE.itemsize)
        if r1 or r2 or r3:
            raise InvalidMessage("ragged_bytes", f"completion {i}")
        if not (n_tok == n_lp == n_ver):
            raise InvalidMessage("length_mismatch", f"completion {i}: {n_tok}/{n_lp}/{n_ver}")
        if limits.max_new_tokens and n_tok > limits.max_new_tokens:
            raise InvalidMessage("completion_too_long", f"completion {i}: {n_tok} > {limits.max_new_tokens}")
        if not math.isfinite(c.reward):
            raise InvalidMessage("nonfinite_reward", f"completion {i}")
        if n_tok:
            _explain_arrays(i, c, limits.vocab_size)
        if c.finish_reason not in _FINISH_REASONS:
            raise InvalidMessage("finish_reason", repr(c.finish_reason)[:32])


def _explain_arrays(i: int, c: Completion, vocab_size: int) -> None:
    lp = c.logprob_array()
    if not np.isfinite(lp).all():
        raise InvalidMessage("nonfinite_logprob", f"completion {i}")
    if (lp > _MAX_LOGPROB).any():
        raise InvalidMessage("positive_logprob", f"completion {i}")
    if (c.version_array() < 0).any():
        raise InvalidMessage("negative_version", f"completion {i}")
    if not _ids_ok(c.token_array(), vocab_size):
        raise InvalidMessage("token_out_of_vocab", f"completion {i}, vocabulary {vocab_size or '?'}")


def make_completion(tokens, logprobs, versions, finish_reason: str, reward: float) -> Completion:
    """Build a Completion from array-likes, converting to the wire dtypes."""
    return Completion(
        tokens=np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE).tobytes(),
        logprobs=np.ascontiguousarray(logprobs, dtype=LOGPROB_DTYPE).tobytes(),
        versions=np.ascontiguousarray(versions, dtype=VERSION_DTYPE).tobytes(),
        finish_reason=finish_reason,
        reward=float(reward),
    )


def group_from_samples(samples, rewards, *, actor_id: str, seq: int, group_id: str, task: str, tier: str,
                       prompt, start_version: int, created_at: float = 0.0) -> RolloutGroup:
    """The one way a prompt and its G engine samples (objects with ``tokens``, ``logprobs``,
    ``versions``, ``finish_reason``) become a RolloutGroup; ``rewards`` are one per sample."""
    comps = [make_completion(s.tokens, s.logprobs, s.versions, s.finish_reason, r) for s, r in zip(samples, rewards)]
    return RolloutGroup(actor_id=actor_id, seq=seq, group_id=group_id, task=task, tier=tier,
                        prompt_tokens=np.asarray(prompt, dtype=TOKEN_DTYPE).tobytes(), completions=comps,
                        start_version=start_version, created_at=created_at)
