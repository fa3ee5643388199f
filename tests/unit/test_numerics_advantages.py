"""learner.advantages.group_advantages against hand-computed values."""

import math

import pytest
import torch

from learner.advantages import group_advantages

torch.set_num_threads(1)


def test_one_correct_of_eight():
    rewards = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    std = math.sqrt(0.125 * 0.875)  # population std of a 1-in-8 Bernoulli group
    want = [0.875 / (std + 1e-6)] + [-0.125 / (std + 1e-6)] * 7
    assert group_advantages(rewards)[0].tolist() == pytest.approx(want, rel=1e-12)


def test_population_std_not_sample_std():
    a = group_advantages(torch.tensor([[1.0, 3.0]], dtype=torch.float64), eps=0.0)
    assert a[0].tolist() == pytest.approx([-1.0, 1.0])  # sample std would give +-0.7071


def test_groups_are_independent_and_flat_groups_get_exact_zero():
    rewards = torch.tensor([[0.1] * 6, [2.0, 2.0, 2.0, 5.0, 5.0, 5.0], [0.3] * 6])
    a = group_advantages(rewards)
    assert a[0].tolist() == [0.0] * 6 and a[2].tolist() == [0.0] * 6  # exactly, not ~1e-9 / eps
    assert a[1].tolist() == pytest.approx([-1.5 / (1.5 + 1e-6)] * 3 + [1.5 / (1.5 + 1e-6)] * 3)


def test_integer_rewards_and_bad_shape():
    assert group_advantages(torch.tensor([[0, 1]])).dtype == torch.float32
    with pytest.raises(ValueError, match="num_groups"):
        group_advantages(torch.tensor([1.0, 0.0]))
