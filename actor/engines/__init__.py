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

One file per engine, one line in :data:`ENGINES` (``actor.engine`` selects it).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

from core.registry import resolve
from model.sampling import SamplingSpec


@dataclass
class Sample:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"


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

    @abc.abstractmethod
    def stream(self, prompts: list[list[int]], *, max_new_tokens: int | None = None,
               greedy: bool = False) -> Iterator[tuple[int, Sample]]:
        """``(index into prompts, Sample)`` for every prompt, each index exactly once, as soon as
        its sequence finishes (completion order); sampled as configured unless ``greedy``."""

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int | None = None,
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


def make_engine(actor_cfg, model_dir: str, weights=None, seed: int = 0) -> Engine:
    return resolve(ENGINES, actor_cfg.engine, "engine").from_config(actor_cfg, model_dir, weights, seed)
