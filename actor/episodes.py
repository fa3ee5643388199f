"""Multi-turn episodes, token in and token out (ARCHITECTURE.md, Seams): the environment's answer to a paused
sample is appended as token ids with mask 0. Tools run in the reward pool's sandboxed processes
(actor/rewards.py): one that fails, hangs past ``task.tools.timeout_s`` or breaks a limit answers an error
observation, counted; a stuck tool never stalls the actor.
"""

from __future__ import annotations

import abc
from collections import Counter
from dataclasses import dataclass

import numpy as np

from actor.engines import Sample
from actor.rewards import RewardPool, Sandbox

TOOL_COUNTERS = ("tool/ok", "tool/timeouts", "tool/errors")


class Environment(abc.ABC):
    """What answers a paused sample; ``respond`` gets every sample paused in a round at once."""

    pause_ids: tuple[int, ...] = ()
    max_turns = 4  # policy turns per episode: a pause in the last one ends the episode ("length")

    @abc.abstractmethod
    def respond(self, samples: list[Sample]) -> list[list[int]]:
        """Per sample (its last token a pause id), the environment's token ids."""

    def waiting(self, s: Sample) -> bool:
        return s.finish_reason in ("", "tool") and bool(s.tokens) and s.tokens[-1] in self.pause_ids \
            and (s.mask is None or s.mask[-1] == 1)

    def answer(self, items: list[tuple[Sample, int]]) -> None:
        """Every waiting sample of ``items`` ``(sample, limit)`` gets its turn, in place: the environment's tokens
        appended (cut at the limit), then ``finish_reason`` "" (continue) or "length" (the limit or ``max_turns``)."""
        todo = [(s, limit) for s, limit in items if self.waiting(s)]
        for s, _ in todo:
            if turns(s.mask) >= self.max_turns:
                s.finish_reason = "length"
        todo = [(s, limit) for s, limit in todo if s.finish_reason != "length"]
        for (s, limit), tokens in zip(todo, self.respond([s for s, _ in todo]) if todo else []):
            append(s, tokens, limit)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Release what the environment holds (a tool pool)."""


def append(s: Sample, tokens: list[int], limit: int) -> None:
    tokens = list(tokens)[: limit - len(s.tokens)]
    s.mask = [1] * len(s.tokens) if s.mask is None else s.mask
    s.tokens += tokens
    s.logprobs += [0.0] * len(tokens)
    s.versions += [s.versions[-1]] * len(tokens)
    s.mask += [0] * len(tokens)
    s.finish_reason = "" if len(s.tokens) < limit else "length"


def turns(mask) -> int:
    """The policy's turns in a sample: 1 + the environment's answers (runs of 0 in ``mask``)."""
    m = np.asarray([] if mask is None else mask, dtype=np.int8)
    return 1 + int(((m[1:] == 0) & (m[:-1] == 1)).sum()) if m.size else 1


@dataclass(frozen=True)
class ToolFormat:
    """How a call is written and answered: the call is the text between ``opener`` and ``pause``."""
    opener: str
    pause: str
    answer: str  # the observation, around {result}
    error: str  # the observation of a failed call

    def call(self, text: str) -> str | None:
        start = text.rfind(self.opener)
        return None if start < 0 or not text.endswith(self.pause) else text[start + len(self.opener): -len(self.pause)]


QWEN_RESPONSE = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n")
FORMATS = {  # brackets: the built-in character-level tokenizer's; qwen: Qwen2/Qwen3 chat templates' tool tokens
    "brackets": ToolFormat("[", "]", "={result}\n", "=error\n"),
    "qwen": ToolFormat("<tool_call>", "</tool_call>", QWEN_RESPONSE,
                       QWEN_RESPONSE.replace("{result}", "error: {result}")),
}


class ToolEnvironment(Environment):
    """Calls ``tool`` ("module:function", call text -> result text) in a sandboxed pool, started on the first call."""

    def __init__(self, cfg_tools, tokenizer, tool: str):
        name = cfg_tools.format if cfg_tools.format != "auto" else (
            "qwen" if len(tokenizer.encode("</tool_call>")) == 1 else "brackets")
        self.cfg, self.tok, self.tool, self.fmt = cfg_tools, tokenizer, tool, FORMATS[name]
        pause = tokenizer.encode(self.fmt.pause)
        if len(pause) != 1:
            raise ValueError(f"tool format {name!r}: {self.fmt.pause!r} is {len(pause)} tokens for this tokenizer, "
                             "want one (the token that ends a call)")
        self.pause_ids, self.max_turns = (pause[0],), cfg_tools.max_turns
        self.pool: RewardPool | None = None
        self.counts: Counter = Counter(dict.fromkeys(("tool/malformed", *TOOL_COUNTERS), 0))

    def respond(self, samples: list[Sample]) -> list[list[int]]:
        calls = [self.fmt.call(self.tok.tok.decode(_turn(s), skip_special_tokens=False)) for s in samples]
        todo = [i for i, c in enumerate(calls) if c is not None]
        self.counts["tool/malformed"] += len(calls) - len(todo)
        results = dict(zip(todo, self._pool().call([calls[i] for i in todo]) if todo else []))
        texts = [self.fmt.answer.format(result=results[i]) if results.get(i) is not None else
                 self.fmt.error.format(result="failed" if i in results else "no call") for i in range(len(calls))]
        return [self.tok.encode(t) for t in texts]

    def _pool(self) -> RewardPool:
        if self.pool is None:
            self.pool = RewardPool(self.tool, self.cfg.workers, self.cfg.timeout_s, counters=TOOL_COUNTERS,
                                   sandbox=Sandbox(self.cfg.cpu_s, self.cfg.memory_mb, self.cfg.network))
        return self.pool

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in {**self.counts, **(self.pool.counts if self.pool else {})}.items()}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _turn(s: Sample) -> list[int]:
    """The last turn's sampled tokens."""
    return s.tokens if s.mask is None or 0 not in s.mask else s.tokens[len(s.mask) - s.mask[::-1].index(0):]


def environment(task) -> ToolEnvironment | None:
    tool = task.cfg.tools.tool or getattr(task, "tool", "")
    return ToolEnvironment(task.cfg.tools, task.tok, tool) if tool else None


def episode_metrics(completions) -> dict[str, float]:
    n_turns = [turns(np.frombuffer(c.mask, np.uint8) if c.mask else None) for c in completions]
    sampled = [int(c.sampled().sum()) for c in completions]
    return {"episode/turns": float(np.mean(n_turns)), "episode/turn_tokens": float(sum(sampled) / sum(n_turns)),
            "episode/env_tokens": float(np.mean([c.num_tokens - k for c, k in zip(completions, sampled)])),
            "episode/length": float(np.mean([c.num_tokens for c in completions]))}

