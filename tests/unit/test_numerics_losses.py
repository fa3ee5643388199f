"""Ring-Zero, PPO-clip and TIS losses: hand-computed values, finite-difference gradients,
masking and the two normalisations. Expected numbers are written out from the formulas."""

import math

import pytest
import torch

from learner.losses import LossInputs, kl_per_token, make_loss
from learner.losses.ppo_clip import ppo_clip_loss
from learner.losses.ring_zero import ring_zero_loss
from learner.losses.tis import tis_loss

torch.set_num_threads(1)
D = torch.float64
LN = math.log

# Shared tiny batch: B=2, T=3, the last token of row 0 is padding.
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
LOGP = [[-1.0, -2.0, 0.0], [-0.5, -1.5, -3.0]]
# log-ratio logp - behaviour_logp per token -> ratios 0.5, 3 | 1, 1.5, 2.5
LOG_RATIO = [[LN(0.5), LN(3.0), 0.0], [0.0, LN(1.5), LN(2.5)]]
ADV = [1.0, -2.0]


def _inputs(**kw):
    logp = torch.tensor(LOGP, dtype=D, requires_grad=True)
    beh = logp.detach() - torch.tensor(LOG_RATIO, dtype=D)
    args = dict(logp=logp, behaviour_logp=beh, advantages=torch.tensor(ADV, dtype=D),
                mask=torch.tensor(MASK, dtype=D))
    args.update(kw)
    return LossInputs(**args)


def _grad(loss_fn, inp, **kw):
    loss, metrics = loss_fn(inp, **kw)
    loss.backward()
    return loss.item(), inp.logp.grad.tolist(), metrics


def _close(got, want, tol=1e-12):
    for g_row, w_row in zip(got, want):
        assert g_row == pytest.approx(w_row, abs=tol)


def test_ring_zero_hand_values():
    # rho_hat = min(rho, 2) = 0.5, 2 | 1, 1.5, 2 ; per token -rho_hat * A * logp
    row0 = [-0.5 * 1 * -1.0, -2.0 * 1 * -2.0]  # 0.5, 4.0
    row1 = [-1.0 * -2 * -0.5, -1.5 * -2 * -1.5, -2.0 * -2 * -3.0]  # -1, -4.5, -12
    total = sum(row0) + sum(row1)  # -13
    loss, grad, m = _grad(ring_zero_loss, _inputs(), eps_high=2.0)
    assert loss == pytest.approx(total / 5)
    # d/dlogp = -rho_hat * A / 5; the padded token gets nothing
    _close(grad, [[-0.5 / 5, -2.0 / 5, 0.0], [2.0 / 5, 3.0 / 5, 4.0 / 5]])
    assert m["loss/clip_frac"] == pytest.approx(2 / 5)  # ratios 3 and 2.5 exceed 2
    assert m["learner/loss"] == pytest.approx(total / 5)
    assert "learner/kl_ref" not in m

    loss12, _, _ = _grad(ring_zero_loss, _inputs(token_norm_divisor=12.0), eps_high=2.0)
    assert loss12 == pytest.approx(total / 12)
    loss_s, grad_s, _ = _grad(ring_zero_loss, _inputs(norm="sample"), eps_high=2.0)
    assert loss_s == pytest.approx((sum(row0) / 2 + sum(row1) / 3) / 2)
    _close(grad_s, [[-0.5 / 4, -2.0 / 4, 0.0], [2.0 / 6, 3.0 / 6, 4.0 / 6]])


def test_ppo_clip_hand_values():
    # eps=0.2, clip range [0.8, 1.2]
    # row0 (A=1):  r=0.5 -> min(0.5, 0.8) = 0.5 (unclipped) ; r=3 -> min(3, 1.2) = 1.2 (clipped)
    # row1 (A=-2): r=1 -> -2 ; r=1.5 -> min(-3, -2.4) = -3 ; r=2.5 -> min(-5, -2.4) = -5
    per_token = [-0.5, -1.2, 2.0, 3.0, 5.0]
    loss, grad, m = _grad(ppo_clip_loss, _inputs(), eps_clip=0.2)
    assert loss == pytest.approx(sum(per_token) / 5)
    # unclipped tokens: d(-r A)/dlogp = -r A ; the clipped one (r=3, A>0) exactly 0
    _close(grad, [[-0.5 / 5, 0.0, 0.0], [2.0 / 5, 3.0 / 5, 5.0 / 5]])
    assert grad[0][1] == 0.0
    assert m["loss/clip_frac"] == pytest.approx(1 / 5)


def test_tis_hand_values_without_old_logp_is_vanilla_tis():
    # old = logp: r = 1, w = min(rho, 2) = 0.5, 2 | 1, 1.5, 2 ; loss_t = -w * A * 1
    per_token = [-0.5 * 1, -2.0 * 1, -1.0 * -2, -1.5 * -2, -2.0 * -2]
    loss, grad, m = _grad(tis_loss, _inputs(), eps_high=2.0, eps_clip=0.2)
    assert loss == pytest.approx(sum(per_token) / 5)
    _close(grad, [[-0.5 / 5, -2.0 / 5, 0.0], [2.0 / 5, 3.0 / 5, 4.0 / 5]])  # = Ring-Zero's
    assert m["loss/clip_frac"] == pytest.approx(2 / 5)


def test_tis_hand_values_with_old_logp():
    # one sample, A=1. r = exp(logp - old) = 1.5, 1/1.1 ; w = min(exp(old - beh), 2) = 0.5, min(4, 2)
    logp = torch.tensor([[-1.0, -2.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.0 - LN(1.5), -2.0 + LN(1.1)]], dtype=D)
    beh = old - torch.tensor([[LN(0.5), LN(4.0)]], dtype=D)
    inp = LossInputs(logp, beh, torch.tensor([1.0], dtype=D), torch.ones(1, 2, dtype=D), old_logp=old)
    loss, grad, m = _grad(tis_loss, inp, eps_high=2.0, eps_clip=0.2)
    # tok0: -0.5 * min(1.5, 1.2) = -0.6, clipped -> no gradient ; tok1: -2 * (1/1.1), grad -2/1.1
    assert loss == pytest.approx((-0.6 - 2.0 / 1.1) / 2)
    _close(grad, [[0.0, -2.0 / 1.1 / 2]])
    assert m["loss/clip_frac"] == pytest.approx(0.5)


def test_kl_estimators_hand_values():
    logp = torch.tensor([-1.0, -2.0], dtype=D)
    ref = torch.tensor([-1.5, -1.0], dtype=D)  # log r = ref - logp = -0.5, 1.0
    assert kl_per_token(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_per_token(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    assert kl_per_token(logp, ref, "k3").tolist() == pytest.approx(k3)
    with pytest.raises(ValueError, match="k4"):
        kl_per_token(logp, ref, "k4")


def test_kl_term_in_loss():
    logp = torch.tensor([[-1.0, -2.0]], dtype=D, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=D)
    inp = LossInputs(logp, logp.detach(), torch.zeros(1, dtype=D), torch.ones(1, 2, dtype=D),
                     ref_logp=ref, kl_beta=0.1, kl_estimator="k3")
    loss, grad, m = _grad(ring_zero_loss, inp)
    k3 = [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0]
    assert m["learner/kl_ref"] == pytest.approx(sum(k3) / 2)
    assert loss == pytest.approx(0.1 * sum(k3) / 2)  # A = 0: only the KL term remains
    # d k3 / d logp = 1 - exp(ref - logp)
    _close(grad, [[0.1 * (1 - math.exp(-0.5)) / 2, 0.1 * (1 - math.exp(1.0)) / 2]])


def _random_batch(seed, B=3, T=5, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.05
    beh = logp + torch.randn(B, T, generator=g, dtype=D) * spread
    ref = logp + torch.randn(B, T, generator=g, dtype=D) * 0.3
    adv = torch.randn(B, generator=g, dtype=D)
    mask = torch.ones(B, T, dtype=D)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, beh, ref, adv, mask


@pytest.mark.parametrize("norm", ["token", "sample"])
def test_ppo_and_tis_gradients_match_finite_differences(norm):
    logp, beh, ref, adv, mask = _random_batch(0)
    old = logp + 0.15 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(5), dtype=D)
    kw = dict(norm=norm, ref_logp=ref, kl_beta=0.2)
    for fn in (
        lambda x: ppo_clip_loss(LossInputs(x, beh, adv, mask, **kw), eps_clip=0.2)[0],
        lambda x: tis_loss(LossInputs(x, beh, adv, mask, old_logp=old, **kw), eps_high=1.5)[0],
    ):
        assert torch.autograd.gradcheck(fn, (logp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("norm", ["token", "sample"])
def test_ring_zero_gradient_is_finite_difference_at_fixed_ratio(norm):
    # sg(rho_hat) means: the gradient is the derivative of the loss along directions that leave
    # the ratio unchanged, i.e. moving logp and behaviour_logp together.
    logp, beh, ref, adv, mask = _random_batch(1, spread=1.5)  # many ratios beyond eps_high

    def loss_at(x, b):
        return ring_zero_loss(LossInputs(x, b, adv, mask, norm, ref_logp=ref, kl_beta=0.2), eps_high=2.0)[0]

    x = logp.clone().requires_grad_(True)
    loss_at(x, beh).backward()
    h = 1e-6
    fd = torch.zeros_like(logp)
    for i in range(logp.numel()):
        e = torch.zeros(logp.numel(), dtype=D)
        e[i] = h
        e = e.view_as(logp)
        fd.view(-1)[i] = (loss_at(logp + e, beh + e) - loss_at(logp - e, beh - e)) / (2 * h)
    assert torch.allclose(x.grad, fd, atol=1e-8, rtol=1e-6)


def test_ring_zero_keeps_every_token_where_ppo_zeroes_them():
    B, T = 2, 4
    logp = torch.full((B, T), -1.0, dtype=D)
    beh = logp - 6.0  # rho = e^6 ~ 403 >> eps_high: the learner now loves these tokens
    adv = torch.tensor([1.0, 0.5], dtype=D)  # A > 0: PPO's active side for r > 1 + eps
    mask = torch.ones(B, T, dtype=D)
    grads = {}
    losses = {"ring_zero": make_loss("ring_zero", eps_high=2.0),
              "ppo_clip": make_loss("ppo_clip", eps_clip=0.2)}
    for name, fn in losses.items():
        x = logp.clone().requires_grad_(True)
        loss, m = fn(LossInputs(x, beh, adv, mask))
        loss.backward()
        grads[name] = x.grad
        assert m["loss/clip_frac"] == 1.0
    assert (grads["ring_zero"] != 0).all()
    # exactly -eps_high * A / n_tokens on each token
    assert torch.allclose(grads["ring_zero"], -2.0 * adv[:, None].expand(B, T) / (B * T))
    assert (grads["ppo_clip"] == 0).all()


def test_token_norm_gives_longer_answers_more_gradient_sample_norm_does_not():
    # two correct answers (same A), lengths 1 and 4, ratio 1
    logp = torch.full((2, 4), -1.0, dtype=D)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=D)
    adv = torch.tensor([1.0, 1.0], dtype=D)
    per_sample = {}
    for norm in ("token", "sample"):
        x = logp.clone().requires_grad_(True)
        ring_zero_loss(LossInputs(x, logp, adv, mask, norm, token_norm_divisor=8.0))[0].backward()
        per_sample[norm] = x.grad.abs().sum(dim=1).tolist()
    assert per_sample["token"] == pytest.approx([1 / 8, 4 / 8])  # each token weighs 1/8
    assert per_sample["sample"] == pytest.approx([1 / 2, 1 / 2])  # each sample weighs 1/B


@pytest.mark.parametrize("name", ["ring_zero", "ppo_clip", "tis"])
def test_mask_respected_even_with_garbage_outside(name):
    logp, beh, ref, _, mask = _random_batch(2)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3), dtype=D)  # per token
    pad = mask == 0
    garbage = {"logp": 1e4, "beh": float("nan"), "ref": float("-inf"), "adv": float("inf")}
    values = {"logp": logp, "beh": beh, "ref": ref, "adv": adv}
    dirty = {k: v.masked_fill(pad, garbage[k]) for k, v in values.items()}
    clean = {"logp": logp.masked_fill(pad, 0.0), "beh": beh, "ref": ref, "adv": adv}
    fn = make_loss(name, eps_high=2.0, eps_clip=0.2)
    out = {}
    for label, t in (("dirty", dirty), ("clean", clean)):
        x = t["logp"].clone().requires_grad_(True)
        loss, m = fn(LossInputs(x, t["beh"], t["adv"], mask, ref_logp=t["ref"], kl_beta=0.1))
        loss.backward()
        out[label] = (loss.item(), x.grad, m)
    assert math.isfinite(out["dirty"][0])
    assert out["dirty"][0] == pytest.approx(out["clean"][0], abs=1e-12)
    assert torch.isfinite(out["dirty"][1]).all()
    assert (out["dirty"][1][pad] == 0).all()
    assert (out["dirty"][1][~pad] != 0).any()
    assert out["dirty"][2] == pytest.approx(out["clean"][2])


def test_bad_inputs_raise():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="behaviour_logp"):
        LossInputs(logp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        LossInputs(logp, logp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="norm"):
        LossInputs(logp, logp, torch.zeros(2), torch.ones(2, 3), norm="seq")
    with pytest.raises(ValueError, match="token_norm_divisor"):
        LossInputs(logp, logp, torch.zeros(2), torch.ones(2, 3), token_norm_divisor=0.0)
    with pytest.raises(ValueError, match="unknown loss 'grpo'; known: ppo_clip, ring_zero, tis"):
        make_loss("grpo")


def test_make_loss_binds_parameters():
    inp = _inputs()
    assert make_loss("ring_zero", eps_high=2.0)(inp)[1]["loss/clip_frac"] == pytest.approx(2 / 5)
    assert make_loss("ring_zero", eps_high=10.0)(inp)[1]["loss/clip_frac"] == 0.0
    assert make_loss("tis", eps_high=2.6)(inp)[1]["loss/clip_frac"] == pytest.approx(1 / 5)
    # eps_clip=0.5: the clipped token (r=3, A=1) now contributes -1.5 instead of -1.2
    assert make_loss("ppo_clip", eps_clip=0.5)(inp)[0].item() == pytest.approx((-0.5 - 1.5 + 2 + 3 + 5) / 5)
    # every learner field may be passed: each loss takes only the parameters it names
    assert make_loss("ppo_clip", eps_clip=0.5, eps_high=99.0, lr=1.0)(inp)[0].item() == pytest.approx(
        (-0.5 - 1.5 + 2 + 3 + 5) / 5)
