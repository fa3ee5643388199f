"""The Megatron-core backend against the torch backend on the same small transformers-built checkpoints.

Variants (``tests/unit/test_families.py``'s builder, GQA, 2 layers): Llama with llama3 rope,
attention and MLP biases, untied; Qwen2 (q/k/v biases only) tied; Qwen3 (q/k-norm) untied;
Qwen3 with YaRN (cos/sin scaled) and head_dim != hidden/heads; Llama with attention biases but
none in the MLP. In FP32 the two backends compute the same function, so log-probs agree to float
noise and one AdamW step moves every tensor the same way; the Megatron backend's exports reload in
our engine and in transformers; its checkpoints round-trip, and a checkpoint of either backend
resumes in the other.
"""

import json
import math
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from actor.engines.torch import TorchEngine  # noqa: E402
from learner.backends import make_backend  # noqa: E402
from learner.backends.megatron import MegatronBackend  # noqa: E402
from learner.backends.torch import TorchBackend  # noqa: E402
from learner.batching import collate  # noqa: E402
from model.hf import load_pretrained  # noqa: E402
from model.sampling import SamplingSpec  # noqa: E402
from tests.support.tiny import groups_from_samples, tiny_cfg  # noqa: E402
from tests.unit.test_families import EOS, VOCAB, _build  # noqa: E402

torch.set_num_threads(1)

VARIANTS = ["llama3", "qwen2_sharded_bf16", "qwen3", "qwen3_yarn_bf16"]
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 0.0], [0.2, 0.0, 1.0, 0.0]]


def _without_mlp_biases(src, dst):
    """Llama with attention biases (q/k/v and o_proj) but none in the MLP: a split megatron's one
    ``add_bias_linear`` switch cannot express."""
    shutil.copytree(src, dst)
    state = load_file(f"{dst}/model.safetensors")
    save_file({k: v for k, v in state.items() if not (".mlp." in k and k.endswith(".bias"))},
              f"{dst}/model.safetensors", metadata={"format": "pt"})
    with open(f"{dst}/config.json") as f:
        d = json.load(f)
    (dst / "config.json").write_text(json.dumps({**d, "mlp_bias": False}))
    return str(dst)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    built = {name: _build(name, root / name) for name in VARIANTS}
    built["llama3_attention_bias_only"] = _without_mlp_biases(built["llama3"], root / "llama3_attention_bias_only")
    return built


def _cfg(*overrides):
    return tiny_cfg("learner.body_dtype=float32", "actor.group_size=4", *overrides, resolved=False)


def _engine(path):
    return TorchEngine(load_pretrained(path), SamplingSpec(), eos_ids=[EOS], pad_id=0, max_new_tokens=6,
                       dtype="float32")


def _batch(path, seed=3):
    """Three groups of four FP32 engine samples (exact behaviour log-probs), right-padded."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 4, 2)]
    samples = _engine(path).generate([p for p in prompts for _ in range(4)])
    batch = collate(groups_from_samples(prompts, samples, 4, rewards=REWARDS), learner_version=0, vocab_size=VOCAB)
    assert not batch.key_mask.all()  # padded rows are exercised
    return batch


def _logp(backend, batch):
    with torch.no_grad():
        return backend.logprobs(batch, with_entropy=True)


def _snapshot(backend):
    return {k: v.detach().clone() for k, v in backend.named_tensors().items()}


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


@pytest.mark.parametrize("name", [*VARIANTS, "llama3_attention_bias_only"])
def test_fp32_logprobs_equal_the_torch_backends_on_a_padded_batch(ckpt, name):
    batch = _batch(ckpt[name])
    (want, want_ent), (got, got_ent) = (_logp(b(_cfg(), ckpt[name]), batch) for b in (TorchBackend, MegatronBackend))
    sel = batch.mask > 0
    assert (got[~sel] == 0).all()
    assert (got - want)[sel].abs().max() < 1e-4
    assert (got_ent - want_ent).abs().max() < 1e-4


def test_key_padding_is_masked_in_megatrons_convention(ckpt):
    """The learner's rows are right-padded, where causality alone hides the padding; padding
    before real tokens shows whether the key mask reaches megatron's softmax (True = masked out)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 9), generator=g)
    key_mask = torch.ones(3, 9, dtype=torch.bool)
    key_mask[0, :4] = key_mask[1, 2:5] = False
    ours, theirs = TorchBackend(_cfg(), ckpt["qwen3"]), MegatronBackend(_cfg(), ckpt["qwen3"])
    with torch.no_grad():
        want, got = ours._hidden(ours.model, ids, key_mask), theirs._hidden(theirs.model, ids, key_mask)
        unmasked = theirs._hidden(theirs.model, ids, torch.ones_like(key_mask))
    assert (got - want)[key_mask].abs().max() < 1e-4
    assert (unmasked - want)[key_mask].abs().max() > 1e-2  # the padding would have changed them


def test_selected_by_config_and_publishes_hf_names(ckpt):
    cfg = _cfg("learner.backend=megatron")
    megatron, torch_ = make_backend(cfg, ckpt["llama3"]), TorchBackend(cfg, ckpt["llama3"])
    assert isinstance(megatron, MegatronBackend)
    got, want = megatron.named_tensors(), torch_.named_tensors()
    assert list(got) == list(want)  # the same names, in the same order, as the actors load them
    assert all(torch.equal(got[k], want[k]) for k in want)  # the conversion is exact both ways


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_one_step_moves_every_tensor_as_the_torch_backend_does(ckpt, name):
    """With a KL reference (the frozen copy each backend builds its own way)."""
    cfg = _cfg("learner.lr=1e-3", "learner.kl_beta=0.05")
    batch = _batch(ckpt[name])
    backends = [TorchBackend(cfg, ckpt[name]), MegatronBackend(cfg, ckpt[name])]
    before = [_snapshot(b) for b in backends]
    metrics = [b.step(batch) for b in backends]
    delta = [{k: b.named_tensors()[k] - s[k] for k in s} for b, s in zip(backends, before)]
    overall = _cos(*(torch.cat([d.flatten() for d in side.values()]) for side in delta))
    per_tensor = {k: _cos(delta[0][k], delta[1][k]) for k in delta[0]}
    worst = min(per_tensor, key=per_tensor.get)
    assert overall > 0.99, f"overall cosine {overall}"
    assert per_tensor[worst] > 0.9, f"min per-tensor cosine {per_tensor[worst]} ({worst})"
    for key in ("learner/loss", "learner/grad_norm", "learner/entropy"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-3, abs=1e-6), key
    assert all(p.grad is None for p in backends[1].model.parameters())  # the step was applied and cleared


def test_bf16_body_trains_near_fp32(ckpt):
    """Default precision: a BF16 body under autocast (megatron's own mode for FP32 parameters),
    FP32 softmax and head. Measured on these models: max |dlogp| vs the FP32 torch backend ~0.03
    for both backends; the bound leaves a wide margin and the floor proves BF16 is in use."""
    path, batch = ckpt["qwen3"], _batch(ckpt["qwen3"])
    want, _ = _logp(TorchBackend(_cfg(), path), batch)
    backend = MegatronBackend(_cfg("learner.body_dtype=bfloat16"), path)
    got, _ = _logp(backend, batch)
    diff = (got - want)[batch.mask > 0].abs()
    assert 1e-4 < diff.max() < 0.25
    assert math.isfinite(backend.step(batch)["learner/loss"])


def _hf_token_logp(path, batch):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model.eval()(input_ids=batch.ids, attention_mask=batch.key_mask.long()).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.ids[:, 1:, None]).squeeze(-1)
    return lp * batch.mask


@pytest.mark.parametrize("name", ["llama3", "qwen2_sharded_bf16"])
def test_exported_model_reloads_in_our_engine_and_in_transformers(ckpt, name, tmp_path):
    path, out = ckpt[name], str(tmp_path / "out")
    batch = _batch(path)
    backend = MegatronBackend(_cfg("learner.lr=1e-3"), path)
    backend.step(batch)  # exported weights differ from the input's
    backend.save_model(out)
    with open(f"{path}/config.json") as f, open(f"{out}/config.json") as g:
        assert set(json.load(f)) == set(json.load(g))  # the input's config keys, unchanged
    exported = load_pretrained(out).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in backend.named_tensors().items())
    # our engine: greedy completions of the exported model, scored by the backend
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 3)]
    samples = _engine(out).generate(prompts, greedy=True)
    engine_batch = collate(groups_from_samples(prompts, samples, 1), learner_version=0, vocab_size=VOCAB)
    got, _ = _logp(backend, engine_batch)
    sel = engine_batch.mask > 0
    assert (got - engine_batch.behaviour_logp)[sel].abs().max() < 1e-4
    # transformers, unchanged
    got, _ = _logp(backend, batch)
    assert (_hf_token_logp(out, batch) - got)[batch.mask > 0].abs().max() < 1e-4


def _meta_json(meta):
    return json.loads(json.dumps(meta))  # as learner/checkpoint.py stores it


def _optim_tensors(backend):
    return {f"{i}.{k}": v.clone() for i, st in backend.opt.state_dict()["state"].items() for k, v in st.items()}


def test_save_and_load_state_restore_identical_next_steps(ckpt, tmp_path):
    path = ckpt["qwen3"]
    cfg = _cfg("learner.lr=1e-3")
    first, second = _batch(path, seed=3), _batch(path, seed=4)
    a = MegatronBackend(cfg, path)
    a.step(first)
    meta = _meta_json(a.save_state(str(tmp_path)))
    saved, saved_opt = _snapshot(a), _optim_tensors(a)
    a.step(second)
    b = MegatronBackend(cfg, path)
    b.load_state(str(tmp_path), meta)
    assert all(torch.equal(b.named_tensors()[k], v) for k, v in saved.items())
    restored = _optim_tensors(b)
    assert restored.keys() == saved_opt.keys() and all(torch.equal(restored[k], saved_opt[k]) for k in saved_opt)
    b.step(second)
    after_a, after_b = _snapshot(a), _snapshot(b)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


def test_a_checkpoint_resumes_in_either_backend(ckpt, tmp_path):
    """AdamW's state is stored per HF tensor by both backends: the same files, the same next step."""
    path = ckpt["llama3"]
    cfg = _cfg("learner.lr=1e-3")
    first, second = _batch(path, seed=3), _batch(path, seed=4)
    torch_ = TorchBackend(cfg, path)
    torch_.step(first)
    meta = _meta_json(torch_.save_state(str(tmp_path / "torch")))
    megatron = MegatronBackend(cfg, path)
    megatron.load_state(str(tmp_path / "torch"), meta)
    megatron_meta = _meta_json(megatron.save_state(str(tmp_path / "megatron")))
    assert megatron_meta == meta
    a, b = (load_file(str(tmp_path / d / "optim.safetensors")) for d in ("torch", "megatron"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = _snapshot(torch_)
    torch_.step(second)
    megatron.step(second)
    delta = [torch.cat([(x.named_tensors()[k] - before[k]).flatten() for k in before]) for x in (torch_, megatron)]
    assert _cos(*delta) > 0.99


def test_yarn_attention_factor_megatron_cannot_express_is_refused(ckpt, tmp_path):
    shutil.copytree(ckpt["qwen3_yarn_bf16"], tmp_path / "m")
    with open(tmp_path / "m" / "config.json") as f:
        d = json.load(f)
    d["rope_parameters"]["attention_factor"] = 1.25
    (tmp_path / "m" / "config.json").write_text(json.dumps(d))
    TorchBackend(_cfg(), str(tmp_path / "m"))  # the torch backend runs it
    with pytest.raises(ValueError, match=r"attention_factor=1.25.*learner.backend='megatron'"):
        MegatronBackend(_cfg(), str(tmp_path / "m"))


def test_checkpointed_layers_are_refused_by_name(ckpt):
    with pytest.raises(ValueError, match=r"learner.checkpoint_layers is the torch backend's"):
        MegatronBackend(_cfg("learner.checkpoint_layers=true"), ckpt["llama3"])


def test_attention_island_is_real_under_megatron(tmp_path):
    """``learner.fp32_attn_softmax`` means the same under both backends: with large attention
    logits (tests/unit/test_attention_island.py's model), a BF16 Megatron body is closer to its
    own FP32 log-probs with the island than without. Megatron's bare ``attention_softmax_in_fp32``
    upcasts already-rounded BF16 scores and changes no log-prob at all."""
    from learner.batching import Batch
    from model.hf import save_pretrained
    from tests.unit.test_attention_island import _large_logit_model

    save_pretrained(_large_logit_model(), str(tmp_path))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4, 64), generator=g)
    mask = torch.zeros(4, 63)
    mask[:, 7:] = 1.0
    batch = Batch(ids=ids, key_mask=torch.ones(4, 64, dtype=torch.bool), mask=mask,
                  behaviour_logp=torch.zeros(4, 63), rewards=torch.zeros(1, 4),
                  staleness=torch.zeros(4, dtype=torch.long), keys=[], num_tokens=int(mask.sum()))

    def logp(*overrides):
        backend = MegatronBackend(tiny_cfg("actor.group_size=4", *overrides, resolved=False), str(tmp_path))
        with torch.no_grad():
            return backend.logprobs(batch)[0][mask > 0].double()

    ref = logp("learner.body_dtype=float32")
    on = (logp("learner.body_dtype=bfloat16", "learner.fp32_attn_softmax=true") - ref).abs().mean().item()
    off = (logp("learner.body_dtype=bfloat16", "learner.fp32_attn_softmax=false") - ref).abs().mean().item()
    print(f"megatron island on {on:.3e} off {off:.3e}")
    assert on < 0.85 * off, f"BF16 Megatron body, mean |dlogp| vs its FP32: island on {on:.3e}, off {off:.3e}"
