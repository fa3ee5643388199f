"""learner.logprobs.token_logprobs against a float64 reference, and its chunking / precision knobs."""

import pytest
import torch

from learner.logprobs import token_logprobs
from model.sampling import truncation_mask

torch.set_num_threads(1)


def _setup(B=3, T=11, H=32, V=500, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g) * 0.3  # logits of a few units, like a trained head
    targets = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, targets


def _ref(hidden, weight, targets, temperature=1.0):
    logits = hidden.double() @ weight.double().t() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_fp32_matches_float64_reference():
    hidden, weight, targets = _setup()
    logp, entropy = token_logprobs(hidden, weight, targets, with_entropy=True)
    ref_logp, ref_entropy = _ref(hidden, weight, targets)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    rel = ((logp.double() - ref_logp).abs() / ref_logp.abs()).max().item()
    assert rel < 1e-5, rel
    assert torch.allclose(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-6)


def test_flat_input_matches_batched():
    hidden, weight, targets = _setup()
    batched, _ = token_logprobs(hidden, weight, targets)
    flat, _ = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1))
    assert flat.shape == (targets.numel(),)
    assert torch.allclose(flat, batched.reshape(-1), atol=1e-6, rtol=0)


def test_chunked_equals_unchunked():
    hidden, weight, targets = _setup()
    whole, ent_whole = token_logprobs(hidden, weight, targets, chunk=10_000, with_entropy=True)
    for chunk in (1, 4, 7):  # 33 rows: uneven last chunk included
        part, ent_part = token_logprobs(hidden, weight, targets, chunk=chunk, with_entropy=True)
        # a one-row chunk takes torch's matrix-vector path: a few fp32 ulps apart, no more
        assert torch.allclose(part, whole, atol=1e-6, rtol=2e-6)
        assert torch.allclose(ent_part, ent_whole, atol=1e-6, rtol=2e-6)


def test_temperature_divides_logits():
    hidden, weight, targets = _setup()
    logp_t, _ = token_logprobs(hidden, weight, targets, temperature=0.7)
    ref_t, _ = _ref(hidden, weight, targets, temperature=0.7)
    ref_1, _ = _ref(hidden, weight, targets)
    assert torch.allclose(logp_t.double(), ref_t, rtol=1e-5, atol=1e-6)
    assert (logp_t.double() - ref_1).abs().max() > 0.1  # the temperature really changed the answer


def test_gradient_matches_unchunked_and_reference():
    hidden, weight, targets = _setup()
    upstream = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))

    def grads(chunk):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        logp, ent = token_logprobs(h, w, targets, chunk=chunk, with_entropy=True)
        assert not ent.requires_grad  # a metric: no graph, and not computed again by backward's recompute
        (logp * upstream).sum().backward()
        return h.grad, w.grad

    h_whole, w_whole = grads(10_000)
    h_chunk, w_chunk = grads(5)
    assert torch.allclose(h_chunk, h_whole, atol=1e-5, rtol=1e-5)
    assert torch.allclose(w_chunk, w_whole, atol=1e-5, rtol=1e-5)

    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    ref_logp, _ = _ref(h64, w64, targets)
    (ref_logp * upstream.double()).sum().backward()
    assert torch.allclose(h_chunk.double(), h64.grad, atol=1e-4, rtol=1e-4)
    assert torch.allclose(w_chunk.double(), w64.grad, atol=1e-4, rtol=1e-4)


def test_the_entropy_is_computed_once_per_chunk_and_not_again_by_backwards_recompute(monkeypatch):
    calls, real = [], torch.isinf  # (only the entropy calls it here)
    monkeypatch.setattr(torch, "isinf", lambda x: calls.append(x.shape) or real(x))
    hidden, weight, targets = _setup()
    h = hidden.clone().requires_grad_(True)
    logp, ent = token_logprobs(h, weight, targets, chunk=5, with_entropy=True)
    chunks = -(-targets.numel() // 5)
    assert len(calls) == chunks and ent.shape == targets.shape
    logp.sum().backward()  # every chunk recomputed for its gradient...
    assert len(calls) == chunks and h.grad is not None  # ...up to what backward needs: not the entropy


def test_backward_keeps_no_full_logits():
    # Everything autograd saves outside the per-chunk checkpoints is seen by this hook; with
    # checkpointing no [chunk, V] (let alone [N, V]) logits tensor may be among it.
    hidden, weight, targets = _setup(B=4, T=64, H=16, V=2000)
    h = hidden.requires_grad_(True)
    w = weight.requires_grad_(True)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = token_logprobs(h, w, targets, chunk=32)
    assert sizes, "the hook saw nothing: the test would prove nothing"
    assert max(sizes) < 32 * 2000, max(sizes)
    logp.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_bf16_mode_is_less_accurate_than_fp32_mode():
    # bf16 hidden states in both modes; only the head/log-softmax precision differs
    hidden, weight, targets = _setup(B=2, T=16, H=64, V=8192, dtype=torch.bfloat16)
    ref, _ = _ref(hidden, weight, targets)
    err32 = (token_logprobs(hidden, weight, targets, fp32=True)[0].double() - ref).abs().max().item()
    err16 = (token_logprobs(hidden, weight, targets, fp32=False)[0].double() - ref).abs().max().item()
    assert err32 < 1e-4
    assert err16 > 10 * err32, (err16, err32)


def _ref_truncated(logits, target, top_k, top_p):
    """Sampler support by hand, one row, float64, plain Python."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k:
        kth = logits[order[top_k - 1]]
        order = [i for i in order if logits[i] >= kth]
    z = torch.logsumexp(torch.tensor([logits[i] for i in order], dtype=torch.float64), 0).item()
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += torch.exp(torch.tensor(logits[i] - z, dtype=torch.float64)).item()
    if target not in kept:
        kept.append(target)
    zk = torch.logsumexp(torch.tensor([logits[i] for i in kept], dtype=torch.float64), 0).item()
    return logits[target] - zk


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (8, 0.6)])
def test_top_k_top_p_renormalise_over_sampler_support(top_k, top_p):
    hidden, weight, targets = _setup(B=2, T=5, H=16, V=40)
    targets[0, 0] = (hidden[0, 0].double() @ weight.double().t()).argmin()  # surely outside support
    logp, _ = token_logprobs(hidden, weight, targets, temperature=0.9, top_k=top_k, top_p=top_p)
    logits = (hidden.double() @ weight.double().t() / 0.9).reshape(-1, 40)
    for row, target in enumerate(targets.reshape(-1).tolist()):
        want = _ref_truncated(logits[row].tolist(), target, top_k, top_p)
        assert logp.reshape(-1)[row].item() == pytest.approx(want, abs=1e-5)
    assert torch.isfinite(logp).all()
    plain, _ = token_logprobs(hidden, weight, targets, temperature=0.9)
    assert (logp > plain + 1e-4).any()  # renormalising over fewer tokens raises log-probs


def test_truncation_mask_keeps_top_token_and_ties():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0], [10.0, 0.0, 0.0, 0.0]])
    assert truncation_mask(logits, top_k=2).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert truncation_mask(logits, top_p=0.01)[:, 0].all()
    assert truncation_mask(logits, top_p=0.01).sum().item() == 2


def test_no_tokens_and_bad_input():
    _, weight, _ = _setup()
    none = torch.zeros(0, dtype=torch.long)
    logp, ent = token_logprobs(torch.zeros(0, 32), weight, none, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.zeros(3, 32), weight, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="head_weight"):
        token_logprobs(torch.zeros(3, 16), weight, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(3, 32), weight, torch.zeros(3, dtype=torch.long), temperature=0)


def test_output_dtypes():
    hidden, weight, targets = _setup(B=1, T=4)
    assert token_logprobs(hidden.bfloat16(), weight, targets, fp32=False)[0].dtype == torch.float32
    # fp32 means "at least float32": a float64 reference is not narrowed
    logp64, _ = token_logprobs(hidden.double(), weight.double(), targets)
    assert logp64.dtype == torch.float64
    assert torch.allclose(logp64, _ref(hidden, weight, targets)[0], atol=1e-12, rtol=0)
