"""The ``Engine`` seam: generate completions with behaviour log-probs and per-token versions.
``refresh_weights()`` adopts the newest version from ``weight_source(...)`` (None: fixed weights); when, in
process or in a server: ARCHITECTURE.md, below the seam table.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from numbers import Integral

import msgspec

from core.registry import resolve
from model.sampling import SamplingSpec


class Sample(msgspec.Struct, array_like=True):  # also the partial file's form of a sample (actor/partial.py)
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = ""  # "stop" | "length"; "tool" inside an episode's turn; "": running
    mask: list[int] | None = None  # per token: 1 sampled, 0 the environment's (actor/episodes.py); None: all sampled

    def copy(self, finish_reason: str | None = None) -> "Sample":
        return Sample(list(self.tokens), list(self.logprobs), list(self.versions),
                      self.finish_reason if finish_reason is None else finish_reason,
                      None if self.mask is None else list(self.mask))


class EngineStopped(RuntimeError):
    """The engine's ``stop`` event was set (SIGTERM mid-batch); unfinished samples were never sent."""


class Engine(abc.ABC):
    name = ""
    receives = "tensors"  # weightsync.DELIVERS; or "group": a server joining a torch.distributed group
    stop = None  # a threading.Event the worker sets on SIGTERM; a long generate checks it per step
    supports_prefixes = False  # stream(prefixes=...) continues saved prefixes; _stream then takes ``prefixes``
    on_step = None  # the worker's heartbeat, once per decode step if the engine has steps (no hang)
    env = None  # an Environment (actor/episodes.py): stream runs the turns and returns whole episodes
    _outer: list[int] = []  # the episode loop's current round: inner stream index -> outer prompt index
    _paused: dict[int, Sample] = {}  # samples between two turns, by outer index

    def __init__(self, weights=None):
        self.weights = weights
        self.version = 0 if weights is None else -1  # fixed weights are the initial ones, version 0

    @classmethod
    @abc.abstractmethod
    def from_config(cls, actor_cfg, model_dir: str, weights=None, seed: int = 0) -> "Engine":
        """Build from ``cfg.actor`` and an HF-format model directory (weights and tokenizer)."""

    @classmethod
    def weight_source(cls, cfg, run_dir: str, actor_id: str, *, stop=None, device=None):
        """The subscriber of ``weightsync.transport`` (a GroupLink for a "group" engine)."""
        from weightsync.base import make_subscriber

        return make_subscriber(cfg, run_dir, stop=stop, device=device, actor_id=actor_id)

    def stream(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int] | None = None,
               greedy: bool = False, prefixes: Sequence[Sample | None] | None = None) -> Iterator[tuple[int, Sample]]:
        """``(index, Sample)`` for every prompt, once each, as its sequence finishes (completion order).
        ``max_new_tokens``: None (the engine's own), one limit for all, or one per prompt (tier limits,
        the length curriculum); a sequence that reaches its limit without EOS finishes "length".
        ``prefixes``: per prompt, None or an unfinished Sample to continue (its tokens, log-probs and
        versions start the result; the limit counts them)."""
        if not all(prompts):
            raise ValueError(f"prompt {list(map(bool, prompts)).index(False)} is empty: nothing to condition on")
        n, limit = len(prompts), self.max_new_tokens if max_new_tokens is None else max_new_tokens
        one = isinstance(limit, Integral)
        limits = [limit] * n if one else list(limit)
        if len(limits) != n:
            raise ValueError(f"max_new_tokens has {len(limits)} limits for {n} prompts: give one per prompt")
        for i, b in enumerate(limits):
            if isinstance(b, bool) or not isinstance(b, Integral) or b < 1:
                raise ValueError(f"max_new_tokens{'' if one else f'[{i}]'} = {b!r}: a limit is an integer >= 1")
        if not prompts:
            return iter(())
        limits, prefixes = [int(b) for b in limits], list(prefixes or [None] * n)
        if not any(prefixes) and self.env is None:  # an engine without prefixes is never given any
            return self._stream(prompts, limits, greedy)
        self._check_prefixes(prefixes, limits)
        if self.env is not None:
            return self._episodes(prompts, limits, greedy, prefixes)
        return self._stream(prompts, limits, greedy, prefixes=prefixes)

    def _episodes(self, prompts, limits, greedy, samples) -> Iterator[tuple[int, Sample]]:
        """Rounds of turns: the environment answers every sample paused at a call, then one stream continues
        every unfinished one; an episode is returned when it stops, reaches its limit or is ended."""
        todo, self._paused = list(range(len(prompts))), {}
        while todo:
            self.env.answer([(samples[k], limits[k]) for k in todo if samples[k] is not None])
            for k in [k for k in todo if samples[k] is not None and samples[k].finish_reason]:
                todo.remove(k)
                yield k, samples[k]
            self._outer, self._paused = todo, {k: samples[k] for k in todo if samples[k] is not None}
            stream = self._stream([prompts[k] for k in todo], [limits[k] for k in todo], greedy,
                                  prefixes=[samples[k] for k in todo]) if todo else ()
            for index, s in stream:
                k = todo[index]
                samples[k] = self._paused[k] = s
                if s.finish_reason != "tool":
                    del self._paused[k]
                    yield k, s
            todo = [k for k in todo if samples[k].finish_reason == "tool"]

    def _check_prefixes(self, prefixes, limits) -> None:
        if not self.supports_prefixes:
            raise ValueError(f"the {self.name} engine cannot continue a saved prefix (nor run multi-turn episodes)")
        if len(prefixes) != len(limits):
            raise ValueError(f"{len(prefixes)} prefixes for {len(limits)} prompts: give one (or None) per prompt")
        for i, (p, b) in enumerate(zip(prefixes, limits)):
            if p is not None and (p.finish_reason or len(p.tokens) >= b or not len(p.tokens) == len(p.logprobs)
                                  == len(p.versions) == len(p.tokens if p.mask is None else p.mask)):
                raise ValueError(f"prefix {i}: finished, at its limit ({b}), or tokens, log-probs, versions and "
                                 "mask of different lengths")

    def progress(self) -> dict[int, Sample]:
        """The current stream's unfinished samples by prompt index, their tokens so far (read, never changed,
        between two steps: the ``on_step`` hook), episodes between two turns included; those not started are absent."""
        if self.env is None:
            return self._progress()
        return {**{k: s.copy("") for k, s in self._paused.items()},
                **{self._outer[i]: s for i, s in self._progress().items() if i < len(self._outer)}}

    def _progress(self) -> dict[int, Sample]:
        return {}

    @abc.abstractmethod
    def _stream(self, prompts: list[list[int]], limits: list[int], greedy: bool) -> Iterator[tuple[int, Sample]]:
        """:meth:`stream` of at least one prompt, each with its limit."""

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int] | None = None,
                 greedy: bool = False, prefixes: Sequence[Sample | None] | None = None) -> list[Sample]:
        done = dict(self.stream(prompts, max_new_tokens=max_new_tokens, greedy=greedy, prefixes=prefixes))
        return [done[i] for i in range(len(prompts))]

    def sampling(self) -> SamplingSpec:
        """The distribution the behaviour log-probs describe (checked against the learner's)."""
        return self.spec

    @abc.abstractmethod
    def _apply_weights(self) -> int | None:
        """Apply the newest version from ``self.weights`` if newer than ``self.version``."""

    def refresh_weights(self) -> int:
        """The version now in effect, after adopting the newest complete weights, if any."""
        if self.weights is not None:
            applied = self._apply_weights()
            self.version = self.version if applied is None else applied
        return self.version

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
        if self.weights is not None:
            self.weights.close()


ENGINES = {"torch": "actor.engines.torch:TorchEngine", "sglang": "actor.engines.sglang:SGLangEngine"}


def engine_class(name: str) -> type[Engine]:
    return resolve(ENGINES, name, "engine")


def make_engine(actor_cfg, model_dir: str, weights=None, seed: int = 0) -> Engine:
    return engine_class(actor_cfg.engine).from_config(actor_cfg, model_dir, weights, seed)
