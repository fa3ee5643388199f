"""A real SGLang server behind the engine: start, health, generate, stop. Needs CUDA and a full
SGLang 0.5.23 venv (``pip install "sglang[all]==0.5.23"``) named by ``DRIFTRL_SGLANG_PYTHON``;
skipped otherwise (the CPU contract tests are ``test_contract.py``)."""

from __future__ import annotations

import math
import os

import pytest

from actor.engines import make_engine
from tests.support.tiny import tiny_cfg

SGLANG_PYTHON = os.environ.get("DRIFTRL_SGLANG_PYTHON", "")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not SGLANG_PYTHON, reason="DRIFTRL_SGLANG_PYTHON (a full SGLang venv's python) is not set")
def test_real_server_generates_samples_with_logprobs_and_versions():
    cfg = tiny_cfg("actor.engine=sglang", f"actor.sglang.python={SGLANG_PYTHON}", "actor.max_new_tokens=6",
                   "actor.sglang.mem_fraction=0.3", "actor.sglang.start_timeout_s=900")
    engine = make_engine(cfg.actor, cfg.model.path, weights=None, seed=1)
    try:
        prompts = [[1, 5, 7], [1, 9], [1, 4, 4, 4], [1, 3]]
        for greedy in (True, False):
            samples = engine.generate(prompts, greedy=greedy)
            assert len(samples) == len(prompts)
            for s in samples:
                assert 1 <= len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens) == len(s.versions)
                assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
                assert set(s.versions) == {0} and s.finish_reason in ("stop", "length")
        again = engine.generate(prompts, greedy=True)
        assert [s.tokens for s in again] == [s.tokens for s in engine.generate(prompts, greedy=True)]
    finally:
        engine.close()
    assert not engine.server.alive()
