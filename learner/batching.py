"""RolloutGroups -> padded tensors aligned for next-token log-probs: row ``i`` is ``prompt +
completion`` right-padded, column ``j`` of every ``[N, L-1]`` tensor is about ``ids[i, j+1]``.
:func:`collate` is the learner's last check of the data: ValueError, and the batch is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from core import messages as M

TENSORS = ("ids", "key_mask", "mask", "behaviour_logp", "rewards", "staleness", "versions")  # Batch's, in order


@dataclass
class Batch:
    ids: torch.Tensor  # [N, L] int64
    key_mask: torch.Tensor  # [N, L] bool, False on padding
    mask: torch.Tensor  # [N, L-1] float, 1 where ids[:, j+1] is a sampled completion token (not the environment's)
    behaviour_logp: torch.Tensor  # [N, L-1] float32
    rewards: torch.Tensor  # [num_groups, G] float32
    staleness: torch.Tensor  # [N] int64: learner version - oldest token version of the sample
    keys: list[tuple[str, int]]
    num_tokens: int  # completion tokens
    versions: torch.Tensor | None = None  # [N, L-1] int64: each completion token's policy version (0 elsewhere)
    group_ids: list[str] = field(default_factory=list)  # per group: its prompt's group_id

    @property
    def group_size(self) -> int:
        return self.rewards.shape[1]

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows ``start:stop``, columns trimmed to their longest row; ``rewards`` and ``keys``
        stay the whole step's (advantages are taken over whole groups first)."""
        width = int(self.key_mask[start:stop].sum(dim=1).max())
        mask = self.mask[start:stop, : width - 1]
        return replace(self, ids=self.ids[start:stop, :width], key_mask=self.key_mask[start:stop, :width],
                       mask=mask, behaviour_logp=self.behaviour_logp[start:stop, : width - 1],
                       staleness=self.staleness[start:stop], num_tokens=int(mask.sum().item()),
                       versions=None if self.versions is None else self.versions[start:stop, : width - 1])


# a micro-batch of length-sorted rows also ends where the next row is this much longer than its
# first, once it holds BUCKET_MIN_TOKENS padded tokens: padding every row to the step's longest
# wastes a third of its FLOPs (default job: learner step 28 % faster), an extra pass costs a few ms
BUCKET_GROWTH = 1.25
BUCKET_MIN_TOKENS = 256


def by_length(batch: Batch) -> tuple[Batch, torch.Tensor]:
    """``batch``'s rows stably sorted by length and the order (``sorted[i]`` is ``batch[order[i]]``)."""
    order = torch.argsort(batch.key_mask.sum(dim=1), stable=True)
    rows = {f: getattr(batch, f)[order] for f in ("ids", "key_mask", "mask", "behaviour_logp", "staleness")}
    return replace(batch, **rows, versions=None if batch.versions is None else batch.versions[order]), order


def micro_batches(batch: Batch, max_tokens: int, min_tokens: int = BUCKET_MIN_TOKENS) -> list[tuple[int, int]]:
    """Row ranges of consecutive micro-batches of at most ``max_tokens`` padded tokens (0: all; at least one
    row), cut also where a longer row starts a new length bucket (rows sorted by :func:`by_length`)."""
    n = batch.ids.shape[0]
    if not max_tokens:
        return [(0, n)]
    lengths = batch.key_mask.sum(dim=1).tolist()
    ranges, start, widest = [], 0, 0
    for i, length in enumerate(lengths):
        full = (i - start + 1) * max(widest, length) > max_tokens
        bucket = length > BUCKET_GROWTH * lengths[start] and (i - start) * widest >= min_tokens
        if i > start and (full or bucket):
            ranges.append((start, i))
            start, widest = i, 0
        widest = max(widest, length)
    ranges.append((start, n))
    return ranges


def collate(groups: list[M.RolloutGroup], learner_version: int, pad_id: int = 0, vocab_size: int = 0) -> Batch:
    """Raises ValueError naming the first group a batch cannot be built from."""
    if not groups:
        raise ValueError("empty batch")
    G = len(groups[0].completions)
    rows, stale = [], []  # (prompt + completion, prompt length, completion) per row
    for g, verdict in zip(groups, M.validate_groups(groups)):
        if isinstance(verdict, M.InvalidMessage):
            raise verdict
        if len(g.completions) != G:
            raise ValueError("all groups in a batch must have the same number of completions "
                             f"({g.key}: {len(g.completions)}, first group: {G})")
        prompt = np.frombuffer(g.prompt_tokens, dtype=M.TOKEN_DTYPE)
        ids = np.concatenate([prompt, *[c.token_array() for c in g.completions]])
        if ids.size and (ids.min() < 0 or (vocab_size and ids.max() >= vocab_size)):
            raise ValueError(f"{g.key}: token id outside the vocabulary [0, {vocab_size or '?'})")
        for c in g.completions:
            rows.append((np.concatenate([prompt, c.token_array()]), len(prompt), c))
            v = c.version_array()
            stale.append(M.staleness(learner_version, int(v.min()) if len(v) else g.start_version))
    n, width = len(rows), max(len(row) for row, _, _ in rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    key_mask = torch.zeros(n, width, dtype=torch.bool)
    mask, blp = torch.zeros(n, width - 1), torch.zeros(n, width - 1)
    versions = torch.zeros(n, width - 1, dtype=torch.long)
    for i, (row, s, c) in enumerate(rows):
        ids[i, : len(row)] = torch.from_numpy(row.astype(np.int64))
        key_mask[i, : len(row)] = True
        mask[i, s - 1 : len(row) - 1] = torch.from_numpy(c.sampled().astype(np.float32))
        blp[i, s - 1 : len(row) - 1] = torch.from_numpy(c.logprob_array().copy())
        versions[i, s - 1 : len(row) - 1] = torch.from_numpy(c.version_array().astype(np.int64))
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups], dtype=torch.float32)
    return Batch(ids, key_mask, mask, blp, rewards, torch.tensor(stale, dtype=torch.long),
                 [g.key for g in groups], int(mask.sum().item()), versions, [g.group_id for g in groups])
