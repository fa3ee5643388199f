"""Tail forensics: ``ratio/p99`` says *that* the tail moved; ``tail.jsonl`` says *which tokens* make it: per
step the ``tail_k`` response tokens with the largest ratio above 1 ("high") and the smallest below 1 ("low"),
where they sit and how stale they are (the token's own version when known), so ``run.py tail``
(learner/tailview.py) can tell a stale-sample tail from a first-token, an EOS or a precision one.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Callable, Sequence

from core.messages import staleness
from learner.checkpoint import WriteError

if TYPE_CHECKING:  # tensor methods only: `run.py tail` reads TAIL_FILE without importing torch
    from torch import Tensor

    from learner.batching import Batch

TAIL_FILE = "tail.jsonl"
# every record's keys, in order (the viewer reads these names)
RECORD_FIELDS = ("step", "version", "direction", "ratio", "log_ratio", "logp", "behaviour_logp",
                 "token_id", "text", "position", "length", "staleness", "prompt_id", "group", "sample")
# exp() of more overflows a float64, and JSON has no inf: the ratio is capped there (log_ratio is exact)
MAX_LOG_RATIO = 709.0

Decode = Callable[[Sequence[int]], list[str]]


def pick(log_ratio: Tensor, mask: Tensor, k: int) -> list[tuple[str, int, int]]:
    """``(direction, row, column)`` of the ``k`` response tokens with the largest ``log_ratio`` above 0
    ("high", largest first) and the ``k`` smallest below 0 ("low", smallest first)."""
    out, width = [], mask.shape[1]
    for direction, v in (("high", log_ratio), ("low", -log_ratio)):
        idx = ((mask > 0) & (v > 0)).reshape(-1).nonzero().squeeze(1)
        best = v.reshape(-1)[idx].topk(min(k, idx.numel())).indices
        out += [(direction, i // width, i % width) for i in idx[best].tolist()]
    return out


def records(batch: Batch, logp: Tensor, *, step: int, version: int, k: int, decode: Decode) -> list[dict]:
    """The step's tail records (keys :data:`RECORD_FIELDS`), "high" first. ``version``: the one whose
    weights scored the batch; ``logp``: the learner's ``[N, L-1]`` log-probs, aligned with ``batch.mask``."""
    if tuple(logp.shape) != tuple(batch.mask.shape):
        raise ValueError(f"logp {tuple(logp.shape)} must be shaped like the batch's mask {tuple(batch.mask.shape)}")
    lr = logp.double() - batch.behaviour_logp.double()
    picks = pick(lr, batch.mask, k)
    sel = batch.mask > 0  # a row's response from its first sampled column; length: its sampled tokens
    start, length = sel.int().argmax(dim=1).tolist(), sel.sum(dim=1).tolist()
    texts = decode([int(batch.ids[r, c + 1]) for _, r, c in picks])  # column j predicts ids[:, j+1]
    out = []
    for (direction, r, c), text in zip(picks, texts):
        g, log_r = r // batch.group_size, float(lr[r, c])
        actor_id, seq = batch.keys[g]
        stale = int(batch.staleness[r]) if batch.versions is None else staleness(version, int(batch.versions[r, c]))
        out.append(dict(zip(RECORD_FIELDS, (
            step, version, direction, math.exp(min(log_r, MAX_LOG_RATIO)), log_r, float(logp[r, c]),
            float(batch.behaviour_logp[r, c]), int(batch.ids[r, c + 1]), text, c - start[r], length[r], stale,
            batch.group_ids[g] if batch.group_ids else "", f"{actor_id}:{seq}", r % batch.group_size))))
    return out


def token_decoder(tokenizer) -> Decode:
    """One text per id of a model.tokenizer.Tokenizer, special tokens included (EOS in the tail is a finding)."""
    return lambda ids: tokenizer.tok.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)


class TailWriter:
    """Appends ``{step, version, tokens, k, records}`` per step to ``run_dir/tail.jsonl``; not fsynced
    (forensics, not recovery state). A resumed run rewrites rolled-back steps: the last line per step wins."""

    def __init__(self, run_dir: str, k: int, decode: Decode):
        self.path, self.k, self.decode = os.path.join(run_dir, TAIL_FILE), k, decode

    def write(self, step: int, version: int, batch: Batch, logp: Tensor) -> None:
        recs = records(batch, logp, step=step, version=version, k=self.k, decode=self.decode)
        line = json.dumps({"step": step, "version": version, "tokens": batch.num_tokens, "k": self.k,
                           "records": recs}, ensure_ascii=False)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            raise WriteError("the tail log", self.path, e) from None


def writer_for(cfg, run_dir: str) -> TailWriter | None:
    """The run's writer, decoding with the model's tokenizer; None when ``learner.tail_k`` is 0."""
    from model.tokenizer import Tokenizer

    k = cfg.learner.tail_k
    return TailWriter(run_dir, k, token_decoder(Tokenizer.from_dir(cfg.model.path))) if k else None
