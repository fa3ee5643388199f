"""The torch backend on a tiny real model: the log-prob numerator, one learning step, NaN containment."""

import copy
import dataclasses
import os
import random

import pytest
import torch

from actor.tasks import Prompt
from learner.backends import NonFiniteError
from learner.backends.torch import TorchBackend, _alone
from learner.batching import Batch, by_length, collate, micro_batches
from model.sampling import sampling_logprobs
from tests.support.tiny import groups_from_samples, make_group, tiny_cfg, tiny_engine, tiny_model, tiny_task

torch.set_num_threads(1)


def Trainer(cfg, model):
    return TorchBackend(cfg, "", model=model)


@pytest.fixture(scope="module")
def engine_batch():
    """8 prompts x 4 completions sampled by the engine (FP32, T=1): behaviour log-probs are exact."""
    task = tiny_task()
    rng = random.Random(0)
    prompts = [list(task.sample(rng).tokens) for _ in range(8)]
    samples = tiny_engine().generate([p for p in prompts for _ in range(4)])
    return collate(groups_from_samples(prompts, samples, 4), learner_version=0)


def _float64_reference(model, batch, temperature):
    """log p of each masked target from a float64 copy, one unpadded sequence at a time."""
    m = copy.deepcopy(model).double()
    out = torch.zeros(batch.mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(batch.ids.shape[0]):
            n = int(batch.key_mask[i].sum())
            ids = batch.ids[i, :n][None]
            h = m(ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))[0]
            # not m.logits(): it casts to float32, and this reference must stay float64
            lp = torch.log_softmax((h @ m.head_weight().t()) / temperature, dim=-1)
            out[i, : n - 1] = lp[:-1].gather(-1, batch.ids[i, 1:n, None]).squeeze(-1)
    return out * batch.mask.double()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_logprobs_match_float64_reference(engine_batch, temperature):
    cfg = tiny_cfg("learner.body_dtype=float32", f"actor.temperature={temperature}")
    trainer = Trainer(cfg, tiny_model())
    with torch.no_grad():
        got, _ = trainer.logprobs(engine_batch)
    ref = _float64_reference(trainer.model, engine_batch, temperature)
    sel = engine_batch.mask > 0
    assert got.dtype == torch.float32
    assert (got[~sel] == 0).all()
    # 1e-5 relative, 1e-5 absolute: FP32 rounding of a log-softmax over logits of tens (T = 0.7 scales them up)
    # reaches a few 1e-6 on some batches; a BF16 head or softmax would be off by ~1e-2
    torch.testing.assert_close(got[sel].double(), ref[sel], rtol=1e-5, atol=1e-5)


def test_bf16_body_is_close_to_fp32_behaviour_but_not_equal(engine_batch):
    """Default precision (bf16 body, fp32 softmax + head) vs the FP32 engine: the ratio sits near
    1 and is never exactly 1 everywhere -- that gap is the train/inference mismatch the ratio
    metrics exist to measure. Measured on this tiny model: max |dlogp| ~0.07, mean ~0.003;
    with an FP32 body the same comparison gives max ~2e-6."""
    sel = engine_batch.mask > 0
    diffs = {}
    for body in ("float32", "bfloat16"):
        trainer = Trainer(tiny_cfg(f"learner.body_dtype={body}"), tiny_model())
        with torch.no_grad():
            lp, _ = trainer.logprobs(engine_batch)
        diffs[body] = (lp - engine_batch.behaviour_logp)[sel].abs()
    assert diffs["float32"].max() < 1e-4
    bf16 = diffs["bfloat16"]
    assert bf16.mean() < 0.02 and bf16.max() < 0.5  # ratio within ~[0.6, 1.65] on every token
    assert bf16.max() > 1e-3 and bf16.mean() > 10 * diffs["float32"].mean()


def _on_policy_group(model, temperature=1.0):
    """One prompt, four distinct answers (the first correct), behaviour log-probs from a full FP32
    forward of the same weights: exactly on-policy, ratio 1."""
    task = tiny_task()
    tok = task.tok
    prompt = [tok.bos_id, *tok.encode("47+38=")]
    p = Prompt("47+38", tuple(prompt), answer="85")
    answers = ["85", "12", "30", "64"]  # wrong answers share no digit with the right one
    comps = []
    for text in answers:
        toks = tok.encode(text) + [tok.eos_id]
        ids = torch.tensor([prompt + toks])
        n = ids.shape[1]
        with torch.no_grad():
            logits = model.logits(model(ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool)))[0]
        lp = sampling_logprobs(logits, temperature)[len(prompt) - 1:-1].gather(-1, torch.tensor(toks)[:, None])
        comps.append((toks, lp.squeeze(-1).tolist(), [0] * len(toks), "stop", task.reward(p, toks)))
    assert [c[4] for c in comps] == [1.0, 0.0, 0.0, 0.0]
    return make_group(prompt, comps)


def _sample_logp(trainer, batch):
    with torch.no_grad():
        lp, _ = trainer.logprobs(batch)
    return (lp * batch.mask).sum(-1)


def test_positive_advantage_raises_that_samples_logprob():
    """Direction, with margins that hold on any CPU. Adam's first steps move every weight by ~lr whatever
    its gradient, so a large lr breaks the tiny model (at 1e-3 on an AMX Xeon every answer lost 2-6 nats);
    at 1e-4 each step is small enough to follow the gradient: the advantage-weighted log-likelihood rises at
    every step, and the rewarded answer gains on every unrewarded one by 10x the cross-CPU noise (~1e-3)."""
    trainer = Trainer(tiny_cfg("learner.body_dtype=float32", "learner.lr=1e-4"), tiny_model())
    batch = collate([_on_policy_group(trainer.model)], learner_version=0)
    adv = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3])  # one right answer of four: its sign pattern
    before, objective, grad_norms = _sample_logp(trainer, batch), [], []
    for _ in range(5):
        grad_norms.append(trainer.step(batch)["learner/grad_norm"])
        objective.append(float((adv * (_sample_logp(trainer, batch) - before)).sum()))
    assert min(grad_norms) > 0
    assert objective[0] > 0 and all(b > a for a, b in zip(objective, objective[1:])), objective
    gain = _sample_logp(trainer, batch) - before
    assert gain[0] > gain[1:].max() + 1e-2  # the rewarded answer became more likely than each other one
    assert gain[1:].sum() < -1e-2  # the unrewarded ones, together, less likely


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_nan_behaviour_logprob_never_reaches_optimiser(engine_batch):
    cfg = tiny_cfg("learner.body_dtype=float32")
    trainer = Trainer(cfg, tiny_model())
    before = _params(trainer.model)
    bad = copy.deepcopy(engine_batch)
    i, j = (engine_batch.mask > 0).nonzero()[5].tolist()
    bad.behaviour_logp[i, j] = float("nan")
    bad.rewards[i // bad.group_size] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # a non-zero advantage there
    with pytest.raises(NonFiniteError):
        trainer.step(bad)
    after = _params(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert not trainer.opt.state  # AdamW never stepped: no moments, no step count

    # the failed step left nothing behind: the next clean step equals a fresh trainer's first step
    good = copy.deepcopy(bad)
    good.behaviour_logp = engine_batch.behaviour_logp.clone()
    trainer.step(good)
    fresh = Trainer(cfg, tiny_model())
    fresh.step(good)
    got, want = _params(trainer.model), _params(fresh.model)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert not torch.equal(got["model.norm.weight"], before["model.norm.weight"])  # it did learn


def test_garbage_outside_response_mask_is_ignored(engine_batch):
    """inf/NaN at prompt or padding positions (mask 0) must not touch the loss or the gradient."""
    cfg = tiny_cfg("learner.body_dtype=float32")
    batch = copy.deepcopy(engine_batch)
    batch.rewards[:, 0] = 1.0  # give every group a learning signal
    dirty = copy.deepcopy(batch)
    dirty.behaviour_logp[batch.mask == 0] = float("nan")
    dirty.behaviour_logp[0, 0] = float("-inf")
    clean_tr, dirty_tr = Trainer(cfg, tiny_model()), Trainer(cfg, tiny_model())
    m_clean = clean_tr.step(batch)
    m_dirty = dirty_tr.step(dirty)
    assert m_dirty["learner/loss"] == m_clean["learner/loss"]
    a, b = _params(clean_tr.model), _params(dirty_tr.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_under_safetensors_is_an_oserror(tmp_path, monkeypatch):
    """safetensors reports ENOSPC as its own SafetensorError; the backend raises the OSError it
    is, which the checkpoint writer turns into one clear WriteError."""
    from safetensors import SafetensorError

    from learner import checkpoint
    import learner.backends.torch as backend_mod

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(backend_mod, "save_file", full)
    trainer = Trainer(tiny_cfg(), tiny_model())
    with pytest.raises(checkpoint.WriteError, match=r"cannot write the checkpoint .*step_000001: No space left on device"):
        checkpoint.save(str(tmp_path), 1, trainer, {"version": 1})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("norm", ["token", "sample"])
def test_micro_batches_accumulate_the_full_batch_gradient(engine_batch, norm):
    """Gradient accumulation over micro-batches gives the one-shot gradient and the same metrics:
    memory is bounded by the micro-batch without changing what a step computes."""
    grads, metrics = [], []
    for tokens in (0, 40, 8192):  # 40 padded tokens: a few rows per micro-batch; 8192: length buckets
        cfg = tiny_cfg("learner.body_dtype=float32", f"learner.norm={norm}", f"learner.micro_batch_tokens={tokens}")
        trainer = Trainer(cfg, tiny_model())
        rewards = torch.arange(engine_batch.rewards.numel(), dtype=torch.float32).reshape(engine_batch.rewards.shape) % 3
        metrics.append(trainer.forward_backward(dataclasses.replace(engine_batch, rewards=rewards)))
        grads.append(torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()]))
    assert len(micro_batches(engine_batch, 40)) > 2
    for other in (1, 2):
        torch.testing.assert_close(grads[other], grads[0], rtol=1e-4, atol=1e-7)
        for key in ("learner/loss", "ratio/p99", "learner/entropy"):
            assert metrics[other][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-7)


def test_checkpointed_layers_keep_fewer_activations_for_the_same_gradient(engine_batch):
    """learner.checkpoint_layers: the step computes the same gradient and metrics, while what autograd keeps
    for backward (beyond the weights) is far smaller: each layer's input, not its activations."""
    grads, metrics, kept = [], [], []
    rewards = torch.arange(engine_batch.rewards.numel(), dtype=torch.float32).reshape(engine_batch.rewards.shape) % 3
    for on in (False, True):
        trainer = Trainer(tiny_cfg("learner.body_dtype=float32", f"learner.checkpoint_layers={str(on).lower()}"), tiny_model())
        weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            metrics.append(trainer.forward_backward(dataclasses.replace(engine_batch, rewards=rewards)))
        grads.append(torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()]))
        kept.append(sum(storages.values()))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    for key in ("learner/loss", "ratio/p99", "learner/entropy"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7)
    assert kept[1] < 0.5 * kept[0], kept


def test_length_buckets_cut_padding_and_keep_every_row_in_place():
    """Rows of mixed lengths: sorted and cut into length buckets, they are padded to far fewer
    tokens than one micro-batch; the order maps every sorted row back to its own."""
    lengths = [12, 5, 30, 6, 31, 5, 13, 29] * 16  # 128 rows
    key_mask = torch.arange(32)[None, :] < torch.tensor(lengths)[:, None]
    batch = Batch(ids=torch.arange(128)[:, None].expand(128, 32).clone(), key_mask=key_mask,
                  mask=key_mask[:, 1:].float(), behaviour_logp=torch.zeros(128, 31), rewards=torch.zeros(16, 8),
                  staleness=torch.arange(128), keys=[], num_tokens=0)
    rows, order = by_length(batch)
    assert torch.equal(rows.ids[:, 0], order) and torch.equal(rows.staleness, order)  # rows moved whole
    assert rows.key_mask.sum(1).tolist() == sorted(lengths)
    ranges = micro_batches(rows, 8192)
    padded = sum((b - a) * int(rows.key_mask[a:b].sum(1).max()) for a, b in ranges)
    assert len(ranges) == 3 and padded < 0.7 * 128 * 31  # buckets 5-6, 12-13, 29-31
    assert micro_batches(rows, 8192, min_tokens=10**9) == [(0, 128)]  # too small to be worth a pass


def test_micro_batch_ranges_respect_the_token_budget(engine_batch):
    lengths = engine_batch.key_mask.sum(dim=1)
    ranges = micro_batches(engine_batch, 30)
    assert ranges[0][0] == 0 and ranges[-1][1] == engine_batch.ids.shape[0]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # consecutive, nothing dropped
    for start, stop in ranges:
        assert stop - start == 1 or (stop - start) * int(lengths[start:stop].max()) <= 30
    assert micro_batches(engine_batch, 0) == [(0, engine_batch.ids.shape[0])]


def test_ppo_clip_fraction_is_logged_beside_the_ratio_tail_not_over_it(engine_batch):
    """A loss's own statistic (PPO's clipped-token share) is ``loss/clip_frac``; the backend's
    ``ratio/clip_frac`` (rho > eps_high) is a different number and must not overwrite it."""
    trainer = Trainer(tiny_cfg("learner.body_dtype=float32", 'learner.loss="ppo_clip"', "learner.eps_clip=0.0001"),
                      tiny_model())
    rewards = torch.zeros_like(engine_batch.rewards)
    rewards[:, 0] = 1.0  # one rewarded sample per group: its tokens have A > 0
    batch = dataclasses.replace(engine_batch, rewards=rewards,
                                behaviour_logp=engine_batch.behaviour_logp - 0.5 * engine_batch.mask)
    m = trainer.step(batch)
    assert m["loss/clip_frac"] > 0.1  # ratios ~e^0.5 with A > 0: far outside 1 + 0.0001, clipped
    assert m["ratio/clip_frac"] == 0.0  # none above eps_high = 2


def test_a_checkpoint_writes_the_optimiser_state_in_place_and_copies_only_shared_or_partial_tensors():
    """A whole moment tensor goes to safetensors as it is (no second model-sized copy while saving); a view into a
    larger tensor, a strided one, or a second reference to a storage already written is copied (safetensors refuses
    tensors that share memory), with its values."""
    m, fused, step = torch.randn(8, 4), torch.randn(12, 4), torch.tensor(3.0)
    out = _alone({"m": m, "q": fused[:4], "k": fused[4:], "t": m.t(), "s1": step, "s2": step})
    assert out["m"] is m and out["s1"] is step
    assert all(out[k] is not v and torch.equal(out[k], v) for k, v in
               {"q": fused[:4], "k": fused[4:], "t": m.t(), "s2": step}.items())
    ptrs = [t.untyped_storage().data_ptr() for t in out.values()]
    assert len(set(ptrs)) == len(ptrs) and all(t.is_contiguous() for t in out.values())
