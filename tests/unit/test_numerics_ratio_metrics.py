"""learner.ratio_metrics: the ratio / mismatch metrics (ARCHITECTURE.md: Metric vocabulary) on known inputs, against numpy."""

import math

import numpy as np
import pytest
import torch

from learner.logprobs import token_logprobs
from learner.ratio_metrics import FIXED_KEYS, percentiles, ratio_metrics

torch.set_num_threads(1)
LN = math.log


def _batch():
    # row 0: ratios 0.5, 1, then padding ; row 1: ratios 2, 4, padding garbage
    logp = np.array([[-1.0, -2.0, 0.0], [-0.5, -0.1, 7.0]])
    log_r = np.array([[LN(0.5), 0.0, 0.0], [LN(2.0), LN(4.0), 0.0]])
    beh = logp - log_r
    beh[1, 2] = np.nan  # padding may hold anything
    mask = np.array([[1, 1, 0], [1, 1, 0]], dtype=np.float32)
    return logp, beh, mask


def test_hand_values():
    logp, beh, mask = _batch()
    m = ratio_metrics(logp, beh, mask, eps_high=2.0)
    # ratios sorted: 0.5, 1, 2, 4 ; linear percentile position q/100 * 3
    assert m["ratio/mean"] == pytest.approx(7.5 / 4)
    assert m["ratio/p50"] == pytest.approx(1.5)
    assert m["ratio/p90"] == pytest.approx(2 + 0.7 * 2)
    assert m["ratio/p99"] == pytest.approx(2 + 0.97 * 2)
    assert m["ratio/p999"] == pytest.approx(2 + 0.997 * 2)
    assert (m["ratio/min"], m["ratio/max"]) == pytest.approx((0.5, 4.0))
    assert m["ratio/ess"] == pytest.approx(7.5**2 / (4 * (0.25 + 1 + 4 + 16)))
    assert m["ratio/clip_frac"] == pytest.approx(0.25)  # only 4 > 2 (2 is not > 2)
    k3 = [(0.5 - 1 + LN(2)), 0.0, (2 - 1 - LN(2)), (4 - 1 - LN(4))]
    assert m["mismatch/kl_k3"] == pytest.approx(sum(k3) / 4)
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(LN(2))  # (ln2 + 0 + ln2 + 2 ln2) / 4
    assert m["mismatch/abs_logp_diff_p99"] == pytest.approx(LN(2) + 0.97 * LN(2))
    assert set(m) == set(FIXED_KEYS)


def test_staleness_per_sample_and_per_token():
    logp, beh, mask = _batch()
    per_sample = ratio_metrics(logp, beh, mask, staleness=np.array([0, 3]))
    assert per_sample["ratio/p99_by_staleness/0"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert per_sample["ratio/p99_by_staleness/3"] == pytest.approx(2 + 0.99 * 2)
    # versions can change inside a completion: staleness per token, padding's value ignored
    per_token = ratio_metrics(logp, beh, mask, staleness=torch.tensor([[1, 2, 9], [1, 1, 9]]))
    keys = sorted(k for k in per_token if "by_staleness" in k)
    assert keys == ["ratio/p99_by_staleness/1", "ratio/p99_by_staleness/2"]
    assert per_token["ratio/p99_by_staleness/1"] == pytest.approx(2 + 0.98 * 2)  # 0.5, 2, 4
    assert per_token["ratio/p99_by_staleness/2"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="staleness"):
        ratio_metrics(logp, beh, mask, staleness=np.zeros(5))


def test_matches_numpy_on_random_input_and_torch_bf16_input():
    rng = np.random.default_rng(0)
    logp = -rng.random((8, 50)) * 5
    beh = logp + rng.normal(0, 0.3, size=logp.shape)
    mask = (rng.random((8, 50)) < 0.8).astype(np.float64)
    rho = np.exp((logp - beh)[mask > 0])
    m = ratio_metrics(torch.tensor(logp), torch.tensor(beh), torch.tensor(mask))
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p999", 99.9)):
        assert m[f"ratio/{key}"] == pytest.approx(float(np.percentile(rho, q)), rel=1e-12)
    assert m["ratio/ess"] == pytest.approx(rho.sum() ** 2 / (rho.size * (rho**2).sum()))
    assert percentiles(rho, [5, 95]) == pytest.approx(np.percentile(rho, [5, 95]).tolist())
    # numpy has no bfloat16: tensors are widened on the way in
    m16 = ratio_metrics(torch.tensor(logp).bfloat16(), torch.tensor(beh).bfloat16(), torch.tensor(mask))
    assert m16["ratio/p50"] == pytest.approx(m["ratio/p50"], rel=0.05)


def test_empty_and_bad_input():
    m = ratio_metrics(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)))
    assert set(m) == set(FIXED_KEYS) and all(math.isnan(v) for v in m.values())
    assert all(math.isnan(v) for v in percentiles([], [50, 99]))
    with pytest.raises(ValueError, match="shape"):
        ratio_metrics(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))


def test_bf16_head_widens_the_measured_tail():
    # the point of the FP32 island: same weights, same tokens, only the head precision differs
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 64, 64, generator=g).bfloat16()
    weight = torch.randn(4096, 64, generator=g) * 0.3
    targets = torch.randint(0, 4096, (4, 64), generator=g)
    mask = torch.ones(4, 64)
    behaviour, _ = token_logprobs(hidden.double(), weight.double(), targets)  # an exact sampler
    fp32, _ = token_logprobs(hidden, weight, targets, fp32=True)
    bf16, _ = token_logprobs(hidden, weight, targets, fp32=False)
    tight = ratio_metrics(fp32, behaviour, mask)
    wide = ratio_metrics(bf16, behaviour, mask)
    assert wide["mismatch/abs_logp_diff_p99"] > 10 * tight["mismatch/abs_logp_diff_p99"]
    assert wide["ratio/max"] - 1 > 10 * (tight["ratio/max"] - 1)
    assert wide["mismatch/kl_k3"] > tight["mismatch/kl_k3"]
