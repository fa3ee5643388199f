"""The default job's base model ships with driftrl (model/shipped/): every CPU and every run seed
starts from the same verified weights, and its start lies in one narrow band."""

import collections
import os
import shutil

import pytest
import torch

from actor.engines import make_engine
from actor.tasks import make_task, task_class
from core import config as C
from model import basemodel
from model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def default_model():
    cfg = C.load(None, ['actor.dtype="float32"', "model.cache_dir=/nonexistent/driftrl-cache"])
    return cfg, task_class(cfg.task.name).base_model(cfg)  # shipped: no build, no cache written


def test_the_default_recipe_resolves_to_the_shipped_weights_without_a_build(default_model):
    cfg, path = default_model
    assert os.path.dirname(path) == basemodel.SHIPPED
    assert os.path.basename(path) == f"base-arith-{basemodel.recipe_key(cfg, {})}"  # a recipe change must reship
    assert not os.path.exists("/nonexistent/driftrl-cache")
    other = C.load(None, ["run.seed=7"])  # the run seed does not pick another base model
    assert basemodel.recipe_key(other, {}) == basemodel.recipe_key(cfg, {})
    assert basemodel.recipe_key(C.load(None, ["model.pretrain_seed=1"]), {}) != basemodel.recipe_key(cfg, {})


def test_a_damaged_shipped_model_is_refused_by_name(default_model, tmp_path):
    copy = tmp_path / "base"
    shutil.copytree(default_model[1], copy)
    assert basemodel.verified(str(copy)) == str(copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors is damaged"):
        basemodel.verified(str(copy))


def test_start_reward_for_run_seeds_0_1_2_lies_in_one_narrow_band(default_model):
    """As a run's first evaluation measures it (256 held-out prompts, sampled at T=1, the actor
    seeded by run.seed): a band of width <= 0.1, high enough that RL has a habit to elicit and
    the model knows its arithmetic (few answers are neither the sum nor its reversal)."""
    cfg, path = default_model
    torch.set_num_threads(1)
    task = make_task(cfg.task, Tokenizer.from_dir(path))
    prompts = task.eval_set(cfg.run.eval_prompts)
    starts = []
    for seed in (0, 1, 2):
        samples = make_engine(cfg.actor, path, seed=seed).generate([list(p.tokens) for p in prompts])
        kinds = collections.Counter()
        for p, s in zip(prompts, samples):
            text = task.completion_text(s.tokens)
            kinds["sum" if text == p.answer else "reversed" if text == p.answer[::-1] else "neither"] += 1
        starts.append(kinds["sum"] / len(prompts))
        assert kinds["neither"] / len(prompts) < 0.2, kinds
        assert kinds["reversed"] > kinds["sum"], kinds  # the wrong habit dominates: RL has work to do
    assert max(starts) - min(starts) <= 0.1, starts
    assert 0.15 <= min(starts) and max(starts) <= 0.4, starts
