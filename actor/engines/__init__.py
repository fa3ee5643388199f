"""The ``Engine`` seam: generate completions with behaviour log-probs and per-token versions.

Weights: an engine holds a weight *source* (a ``weightsync`` Subscriber, or None for fixed
weights) and :meth:`Engine.refresh_weights` adopts the newest complete version from it. Who calls
it, and when, is the only difference between the two kinds of engine:

- in process (``torch``): the engine calls it itself before every forward (a decode step, or the
  prefill of newly admitted prompts), so an update lands between two tokens of a running
  sequence and each token records the version that produced it;
- out of process (an inference server such as SGLang, which cannot run a Python callback between
  its decode steps): it pushes the update through the server's own API (HTTP load-from-disk, or
  an NCCL broadcast into the server) when the worker calls it between batches, and tags tokens
  with the version the server reports having applied.

The worker never touches weights directly: it calls ``refresh_weights`` and reads ``version``.

Two ways to get completions: :meth:`Engine.generate` returns one Sample per prompt, in order;
:meth:`Engine.stream` yields ``(index, Sample)`` as each sequence finishes (a continuous-batching
engine finishes short completions first), so the worker can send a group the moment its last
sample is done instead of waiting for the batch's longest sequence. An engine implements
``stream``; ``generate`` is the whole stream put back in prompt order.

Lengths: ``max_new_tokens`` is one limit for every prompt, a list of one per prompt (tier limits
and the length curriculum, ``actor/curriculum.py``), or None for the engine's own
(``actor.max_new_tokens``); :func:`budgets` is the one reading of it. A sequence that reaches its
own limit without EOS finishes "length".

One file per engine, one line in :data:`ENGINES` (``actor.engine`` selects it).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from numbers import Integral

from core.registry import resolve
from model.sampling import SamplingSpec


@dataclass
class Sample:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"


def budgets(max_new_tokens: int | Sequence[int] | None, n: int, default: int) -> list[int]:
    """Each of ``n`` prompts' token limit: ``default`` for None, one int for all, or a list of
    exactly one per prompt; every limit an integer >= 1."""
    if max_new_tokens is None:
        max_new_tokens = default
    if isinstance(max_new_tokens, Integral):
        return [_limit(max_new_tokens, "max_new_tokens")] * n
    limits = list(max_new_tokens)
    if len(limits) != n:
        raise ValueError(f"max_new_tokens has {len(limits)} limits for {n} prompts: give one per prompt")
    return [_limit(b, f"max_new_tokens[{i}]") for i, b in enumerate(limits)]


def _limit(b, name: str) -> int:
    if isinstance(b, bool) or not isinstance(b, Integral) or b < 1:
        raise ValueError(f"{name} = {b!r}: a limit is an integer >= 1")
    return int(b)


class EngineStopped(RuntimeError):
    """Generation given up because the engine's ``stop`` event was set (SIGTERM mid-batch): the
    unfinished samples were never sent, so nothing accepted is lost."""


class Engine(abc.ABC):
    name = ""
    stop = None  # a threading.Event the worker sets on SIGTERM; a long generate checks it per step
    # called once per decode step by an engine that has steps (the worker's heartbeat: one long
    # sequence of a big model can take minutes between two finished samples, and is not a hang)
    on_step = None

    def __init__(self, weights=None):
        self.weights = weights
        self.version = 0 if weights is None else -1  # fixed weights are the initial ones, version 0

    @classmethod
    @abc.abstractmethod
    def from_config(cls, actor_cfg, model_dir: str, weights=None, seed: int = 0) -> "Engine":
        """Build from ``cfg.actor`` and an HF-format model directory (weights and tokenizer)."""

    @classmethod
    def weight_source(cls, cfg, run_dir: str, actor_id: str, *, stop=None, device=None):
        """How this engine receives the learner's weights: by default a subscriber of
        ``weightsync.transport`` (weightsync/base.py); a server engine that receives them itself
        (SGLang over NCCL) returns its own link. The worker asks, and names no engine."""
        from weightsync.base import make_subscriber

        return make_subscriber(cfg, run_dir, stop=stop, device=device)

    @abc.abstractmethod
    def stream(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int] | None = None,
               greedy: bool = False) -> Iterator[tuple[int, Sample]]:
        """``(index into prompts, Sample)`` for every prompt, each index exactly once, as soon as
        its sequence finishes (completion order); sampled as configured unless ``greedy``.
        ``max_new_tokens``: one limit, one per prompt, or None for the engine's (:func:`budgets`)."""

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int] | None = None,
                 greedy: bool = False) -> list[Sample]:
        """One Sample per prompt, in prompt order (the whole of :meth:`stream`)."""
        out: list[Sample | None] = [None] * len(prompts)
        for i, sample in self.stream(prompts, max_new_tokens=max_new_tokens, greedy=greedy):
            out[i] = sample
        return out

    @abc.abstractmethod
    def sampling(self) -> SamplingSpec:
        """The distribution the behaviour log-probs describe (checked against the learner's)."""

    @abc.abstractmethod
    def _apply_weights(self) -> int | None:
        """Apply the newest version from ``self.weights`` if newer than ``self.version``."""

    def refresh_weights(self) -> int:
        """Adopt the newest complete weights, if any; returns the version now in effect."""
        if self.weights is not None:
            applied = self._apply_weights()
            if applied is not None:
                self.version = applied
        return self.version

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()


ENGINES = {"torch": "actor.engines.torch:TorchEngine", "sglang": "actor.engines.sglang:SGLangEngine"}


def engine_class(name: str) -> type[Engine]:
    return resolve(ENGINES, name, "engine")


def make_engine(actor_cfg, model_dir: str, weights=None, seed: int = 0) -> Engine:
    return engine_class(actor_cfg.engine).from_config(actor_cfg, model_dir, weights, seed)
