"""The FP32 attention-softmax island is real: with it on, a BF16 body's log-probs are closer to a
float64 reference than with it off, on the learner's path and on the engine's cached path.

The model is built so that attention logits are large and coherent, where BF16 rounding of the
scores bites: every layer's q and k carry a shared bias vector ``u`` (Qwen2 has q/k/v biases), so
``q . k`` is ~``|u|^2 cos(angle)`` -- logits of order 10 that vary with distance -- while the
rounding of q and k themselves (random per element) adds up to ``sqrt(head_dim)`` times less.
Everything else (tokens, positions, the FP32 head) is the same for both settings, so the gap is
the island's alone.
"""

import copy

import torch

from actor.engines.torch import TorchEngine
from learner.logprobs import token_logprobs
from model.arch import ArchConfig
from model.decoder import Decoder, attention_probs, body_autocast
from model.sampling import SamplingSpec

torch.set_num_threads(1)
CFG = ArchConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, model_type="qwen2",
                 max_position_embeddings=256)


def _large_logit_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(CFG)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        for layer in model.model.layers:
            u = torch.randn(CFG.head_dim)
            u *= 8.5 / u.norm()  # |u|^2 / sqrt(64) ~ 9: the scores' scale
            layer.self_attn.q_proj.bias.copy_(u.repeat(CFG.num_attention_heads))
            layer.self_attn.k_proj.bias.copy_(u)
    return model


def _learner_logp(model, ids, dtype: str, island: bool):
    model.fp32_attn_softmax = island
    pos = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
    with torch.no_grad(), body_autocast(dtype):
        hidden = model(ids[:, :-1], pos, torch.ones_like(pos, dtype=torch.bool))
    return token_logprobs(hidden, model.head_weight(), ids[:, 1:])[0].double()


def _reference(model):
    return copy.deepcopy(model).double()


def test_scores_are_not_rounded_inside_the_island():
    """The island's scores equal an FP32 matmul of the same operands; off, they are BF16."""
    a, b = torch.randn(2, 8, 16, dtype=torch.bfloat16), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    zero = torch.zeros(2, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the learner's context: autocast must not leak in
        on = attention_probs(a, b, zero, 0.25, -1, True, torch.bfloat16)
        off = attention_probs(a, b, zero, 0.25, -1, False, torch.bfloat16)
    exact = torch.softmax(a.float() @ b.float() * 0.25, dim=-1)
    assert on.dtype == torch.float32 and off.dtype == torch.bfloat16
    assert (on - exact).abs().max() < 1e-6
    assert (off.float() - exact).abs().max() > 1e-4


def test_island_brings_the_learner_closer_to_float64():
    model = _large_logit_model()
    ids = torch.randint(0, CFG.vocab_size, (8, 96), generator=torch.Generator().manual_seed(1))
    ref = _learner_logp(_reference(model), ids, "float32", True)
    err = {on: (_learner_logp(model, ids, "bfloat16", on) - ref).abs().mean().item() for on in (True, False)}
    fp32 = (_learner_logp(model, ids, "float32", True) - ref).abs().mean().item()
    msg = f"mean |dlogp| vs float64: island on {err[True]:.2e}, off {err[False]:.2e}, fp32 body {fp32:.2e}"
    print(msg)  # pytest -s shows the figures the README quotes
    assert err[True] < 0.85 * err[False], msg
    assert fp32 < 0.1 * err[True], msg  # the reference really is the model, BF16 the error


def _engine_logp_error(model, island: bool) -> float:
    """Mean |engine log-prob - float64 log-prob| of the tokens a BF16 engine sampled."""
    ref_model = _reference(model)
    engine = TorchEngine(copy.deepcopy(model), SamplingSpec(), eos_ids=[CFG.vocab_size - 1], pad_id=0,
                         max_new_tokens=48, dtype="bfloat16", fp32_attn_softmax=island, seed=3)
    assert engine.model.fp32_attn_softmax is island
    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, CFG.vocab_size - 1, (24,), generator=rng).tolist() for _ in range(8)]
    errors = []
    for prompt, sample in zip(prompts, engine.generate(prompts)):
        ids = torch.tensor([prompt + sample.tokens])
        ref = _learner_logp(ref_model, ids, "float32", True)[0, len(prompt) - 1:]
        errors.append((torch.tensor(sample.logprobs, dtype=torch.float64) - ref).abs())
    return torch.cat(errors).mean().item()


def test_island_brings_the_cached_engine_closer_to_float64():
    model = _large_logit_model()
    on, off = _engine_logp_error(model, True), _engine_logp_error(model, False)
    msg = f"BF16 engine, mean |dlogp| vs float64: island on {on:.2e}, off {off:.2e}"
    print(msg)
    assert on < 0.85 * off, msg
