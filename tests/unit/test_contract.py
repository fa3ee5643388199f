"""Start-up contract check: passes when actor and learner agree, names the culprit when not."""

import copy

import pytest
import torch

from core.config import LearnerSection
from learner.backends.torch import TorchBackend
from learner.contract import ContractError, check, sample_fixed_batch
from model.sampling import SamplingSpec as Sampling
from tests.support.tiny import tiny_cfg, tiny_engine, tiny_model, tiny_task

torch.set_num_threads(1)
BOUNDS = dict(max_abs=LearnerSection().contract_max_abs_logp_diff,
              max_k3=LearnerSection().contract_max_kl_k3)  # the config defaults


def _setup(temperature=1.0, top_k=0, body="bfloat16"):
    backend = TorchBackend(tiny_cfg(f"learner.body_dtype={body}"), "", model=tiny_model())
    engine = tiny_engine(copy.deepcopy(backend.model), temperature=temperature, top_k=top_k)
    return backend, engine, tiny_task()


def test_identical_settings_pass():
    trainer, engine, task = _setup()
    same = Sampling(1.0, 0, 1.0)
    report = check(trainer, engine, task, same, **BOUNDS)
    assert report["tokens"] > 0
    assert 0 < report["abs_logp_diff_mean"] <= BOUNDS["max_abs"]  # bf16 body: close, not identical
    assert report["kl_k3"] <= BOUNDS["max_k3"]


def test_mismatched_temperature_is_rejected_and_named():
    trainer, engine, task = _setup(temperature=1.0)
    with pytest.raises(ContractError) as err:
        check(trainer, engine, task, Sampling(0.7, 0, 1.0), **BOUNDS)
    msg = str(err.value)
    assert "temperature" in msg and "actor=1.0" in msg and "learner=0.7" in msg
    assert "top_k" not in msg and "top_p" not in msg  # only the setting that differs is blamed


def test_mismatched_top_k_is_rejected_and_named():
    trainer, engine, task = _setup(top_k=3)
    with pytest.raises(ContractError, match="top_k: actor=3 learner=0"):
        check(trainer, engine, task, Sampling(1.0, 0, 1.0), **BOUNDS)


def test_agreeing_settings_with_numeric_gap_point_at_precision():
    """Same sampling settings but a bound tighter than bf16 noise: the message must send the
    reader to the precision switches, not to the sampling settings."""
    trainer, engine, task = _setup()
    same = Sampling(1.0, 0, 1.0)
    with pytest.raises(ContractError, match="body_dtype"):
        check(trainer, engine, task, same, max_abs=1e-7, max_k3=1e-9)
    fp32_trainer, fp32_engine, _ = _setup(body="float32")
    report = check(fp32_trainer, fp32_engine, task, same, max_abs=1e-4, max_k3=1e-6)
    assert report["abs_logp_diff_mean"] < 1e-5  # same numerics on both sides: agreement to rounding


def test_fixed_batch_is_fixed():
    _, engine_a, task = _setup()
    _, engine_b, _ = _setup()
    a, b = sample_fixed_batch(engine_a, task), sample_fixed_batch(engine_b, task)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.behaviour_logp, b.behaviour_logp)
    assert a.rewards.shape == (16, 4) and a.num_tokens > 0
