"""Tail forensics: the tokens behind the ratio's tail, one JSON line per step in ``tail.jsonl``.

``ratio/p99`` says *that* the tail moved; this says *which tokens* make it. Each step the learner
keeps the ``learner.tail_k`` response tokens with the largest ratio ρ = exp(logp − behaviour_logp)
above 1 ("high": the learner now likes them more than the actor did) and the ``tail_k`` with the
smallest below 1 ("low"), so a token is never in both; with where they sit and how old they are,
``python run.py tail`` (learner/tailview.py) can tell a stale-sample tail from a first-token, an EOS
or a precision one. Staleness is the token's own (``version`` − ``Batch.versions``: an update may
land inside a running completion), else the sample's. Only the ``≤ 2k`` picked tokens are decoded.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Callable, Sequence

from learner.checkpoint import WriteError

if TYPE_CHECKING:  # tensor methods only: `run.py tail` reads TAIL_FILE without importing torch
    from torch import Tensor

    from learner.batching import Batch

TAIL_FILE = "tail.jsonl"
# every record's keys, in order (the viewer and the tests read these names)
RECORD_FIELDS = ("step", "version", "direction", "ratio", "log_ratio", "logp", "behaviour_logp",
                 "token_id", "text", "position", "length", "staleness", "prompt_id", "group", "sample")
# exp() of more overflows a float64, and JSON has no inf: the ratio is capped there (log_ratio is exact)
MAX_LOG_RATIO = 709.0

Decode = Callable[[Sequence[int]], list[str]]


def _top(values: Tensor, where: Tensor, k: int) -> list[int]:
    """Flat indices of the (at most) ``k`` largest ``values`` among ``where``, largest first."""
    idx = where.reshape(-1).nonzero().squeeze(1)
    best = values.reshape(-1)[idx].topk(min(k, idx.numel())).indices
    return idx[best].tolist()


def pick(log_ratio: Tensor, mask: Tensor, k: int) -> list[tuple[str, int, int]]:
    """``(direction, row, column)`` of the ``k`` response tokens with the largest ``log_ratio``
    above 0 ("high", largest first) and the ``k`` with the smallest below 0 ("low", smallest
    first); prompt and padding columns (``mask`` 0) are never picked."""
    if k < 0:
        raise ValueError(f"learner.tail_k must be >= 0, got {k}")
    if log_ratio.shape != mask.shape:
        raise ValueError(f"log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)} "
                         "must have one shape")
    width, sel = mask.shape[1], mask > 0
    high = _top(log_ratio, sel & (log_ratio > 0), k)
    low = _top(-log_ratio, sel & (log_ratio < 0), k)
    return [(d, i // width, i % width) for d, flat in (("high", high), ("low", low)) for i in flat]


def spans(mask: Tensor) -> tuple[list[int], list[int]]:
    """First response column and response length of each row (collate marks one contiguous run)."""
    sel = mask > 0
    return sel.int().argmax(dim=1).tolist(), sel.sum(dim=1).tolist()


def records(batch: Batch, logp: Tensor, *, step: int, version: int, k: int, decode: Decode) -> list[dict]:
    """The step's tail records (keys :data:`RECORD_FIELDS`): "high" ones first, then "low".
    ``version`` is the one whose weights scored the batch; ``logp`` the learner's ``[N, L-1]``
    log-probs of the step, aligned with ``batch.mask``; row ``i`` is sample ``i % G`` of group
    ``batch.keys[i // G]``."""
    mask = batch.mask
    if tuple(logp.shape) != tuple(mask.shape):
        raise ValueError(f"logp {tuple(logp.shape)} must be shaped like the batch's mask {tuple(mask.shape)}")
    if mask.shape[0] != len(batch.keys) * batch.group_size:
        raise ValueError(f"{mask.shape[0]} rows are not {len(batch.keys)} groups x {batch.group_size}")
    lr = logp.double() - batch.behaviour_logp.double()
    picks = pick(lr, mask, k)
    start, length = spans(mask)
    texts = decode([int(batch.ids[r, c + 1]) for _, r, c in picks])  # column j predicts ids[:, j+1]
    out = []
    for (direction, r, c), text in zip(picks, texts):
        g, log_r = r // batch.group_size, float(lr[r, c])
        actor_id, seq = batch.keys[g]
        if batch.versions is not None:
            stale = version - int(batch.versions[r, c])
        else:  # per sample [N] or per token [N, L-1]
            stale = int(batch.staleness[r, c] if batch.staleness.dim() == 2 else batch.staleness[r])
        out.append({"step": step, "version": version, "direction": direction,
                    "ratio": math.exp(min(log_r, MAX_LOG_RATIO)), "log_ratio": log_r,
                    "logp": float(logp[r, c]), "behaviour_logp": float(batch.behaviour_logp[r, c]),
                    "token_id": int(batch.ids[r, c + 1]), "text": text, "position": c - start[r],
                    "length": length[r], "staleness": stale,
                    "prompt_id": batch.group_ids[g] if batch.group_ids else "",
                    "group": f"{actor_id}:{seq}", "sample": r % batch.group_size})
    return out


def token_decoder(tokenizer) -> Decode:
    """One text per id, special tokens included (EOS in the tail is a finding, not noise), in one
    ``decode_batch`` call; ``tokenizer`` is a :class:`model.tokenizer.Tokenizer`."""
    return lambda ids: tokenizer.tok.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)


class TailWriter:
    """Appends ``{step, version, tokens, k, records}`` per step to ``run_dir/tail.jsonl``, opened
    and closed each time (not fsynced: forensics, not recovery state). A resumed run writes the
    lines of rolled-back steps again: readers keep the last line per step. A failed write raises
    :class:`WriteError` like every learner write."""

    def __init__(self, run_dir: str, k: int, decode: Decode):
        if k < 1:
            raise ValueError(f"learner.tail_k must be >= 1 for a writer, got {k}")
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
    """The run's writer, decoding with the model directory's tokenizer; None when
    ``learner.tail_k`` is 0 (off)."""
    from model.tokenizer import Tokenizer

    if not cfg.learner.tail_k:
        return None
    return TailWriter(run_dir, cfg.learner.tail_k, token_decoder(Tokenizer.from_dir(cfg.model.path)))
