"""collate(): RolloutGroups -> tensors aligned so column j predicts ids[:, j+1]."""

import numpy as np
import pytest
import torch

from tests.support.tiny import make_group
from learner.batching import collate

PAD = 0


def _groups():
    # two prompts of different lengths, G = 3, completions of different lengths (one empty),
    # log-probs all distinct so any off-by-one pairs the wrong value
    g0 = make_group([1, 11, 12, 13], [
        ([21, 22, 2], [-0.11, -0.12, -0.13], [5, 5, 6], "stop", 1.0),
        ([23], [-0.21], [6], "length", 0.0),
        ([24, 25, 26, 27, 28], [-0.31, -0.32, -0.33, -0.34, -0.35], [4, 5, 5, 6, 6], "length", 0.5),
    ], seq=7, actor_id="a0", start_version=4)
    g1 = make_group([1, 14], [
        ([31, 32], [-0.41, -0.42], [6, 6], "length", 0.0),
        ([], [], [], "length", 0.25),
        ([33, 34, 35, 2], [-0.51, -0.52, -0.53, -0.54], [3, 6, 6, 6], "stop", 1.0),
    ], seq=8, actor_id="a1", start_version=2)
    return [g0, g1]


def _rows(groups):
    for g in groups:
        prompt = np.frombuffer(g.prompt_tokens, dtype=np.int32).tolist()
        for c in g.completions:
            yield g, prompt, c.token_array().tolist(), c.logprob_array().tolist(), c.version_array().tolist()


def test_alignment_tokens_and_behaviour_logprobs():
    groups = _groups()
    b = collate(groups, learner_version=7, pad_id=PAD)
    rows = list(_rows(groups))
    width = max(len(p) + len(t) for _, p, t, _, _ in rows)
    assert b.ids.shape == (6, width) and b.ids.dtype == torch.int64
    assert b.key_mask.shape == (6, width) and b.key_mask.dtype == torch.bool
    assert b.mask.shape == b.behaviour_logp.shape == (6, width - 1)
    for i, (_, prompt, toks, lps, _) in enumerate(rows):
        n = len(prompt) + len(toks)
        assert b.ids[i, :n].tolist() == prompt + toks
        assert (b.ids[i, n:] == PAD).all()
        assert b.key_mask[i].tolist() == [True] * n + [False] * (width - n)
        masked = (b.mask[i] > 0).nonzero().flatten().tolist()
        # position j predicts ids[j+1]: exactly the completion tokens, in order, nothing else
        assert masked == list(range(len(prompt) - 1, n - 1))
        assert [int(b.ids[i, j + 1]) for j in masked] == toks
        assert b.behaviour_logp[i, masked].tolist() == lps
        unmasked = b.mask[i] == 0
        assert (b.behaviour_logp[i][unmasked] == 0).all()
    assert b.num_tokens == sum(len(t) for _, _, t, _, _ in rows) == int(b.mask.sum())


def test_staleness_is_version_minus_oldest_token():
    groups = _groups()
    b = collate(groups, learner_version=7)
    want = []
    for g, _, _, _, versions in _rows(groups):
        want.append(7 - (min(versions) if versions else g.start_version))
    assert b.staleness.tolist() == want == [2, 1, 3, 1, 5, 4]
    assert b.staleness.dtype == torch.int64


def test_rewards_keys_and_group_size():
    b = collate(_groups(), learner_version=7)
    assert b.rewards.shape == (2, 3) and b.group_size == 3
    assert b.rewards.tolist() == [[1.0, 0.0, 0.5], [0.0, 0.25, 1.0]]
    assert b.keys == [("a0", 7), ("a1", 8)]


def test_unequal_group_sizes_rejected():
    g0, _ = _groups()
    short = make_group([1, 2], [([3], [-0.1], [0], "length", 0.0)], seq=9)
    with pytest.raises(ValueError, match="same number of completions"):
        collate([g0, short], learner_version=0)
