"""Llama, Qwen2 and Qwen3 checkpoints written by transformers itself run exactly in driftrl.

Each variant is a small random model built and saved with ``transformers`` (GQA, 2 layers):
Llama with llama3 rope scaling, attention and MLP biases, untied; Llama with linear scaling in the
legacy ``rope_scaling``/``torch_dtype`` spelling, tied; Qwen2 (q/k/v biases) tied, saved sharded
in BF16; Qwen3 untied; Qwen3 with YaRN and head_dim != hidden/heads, in BF16. For every one: the
learner's and the actor's log-probs equal transformers' (FP32, 1e-5), driftrl's output loads
back in transformers with the input's config keys, and a few training steps run and save.
"""

import dataclasses
import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from actor.engines.torch import TorchEngine
from learner.backends.torch import TorchBackend
from learner.batching import collate
from model.decoder import ArchConfig, Decoder
from model.hf import load_pretrained, save_pretrained, tokenizer_files
from model.sampling import SamplingSpec
from tests.support.tiny import groups_from_samples, tiny_cfg

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

VOCAB, EOS, OFFSET = 300, 2, 100  # OFFSET: positions past original_max_position_embeddings (64)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=EOS)
VARIANTS = ["llama3", "llama_linear_legacy", "qwen2_sharded_bf16", "qwen3", "qwen3_yarn_bf16"]


def _hf_config(name):
    t = transformers
    return {
        "llama3": t.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=50000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64)),
        "llama_linear_legacy": t.LlamaConfig(**COMMON, tie_word_embeddings=True,
                                             rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)),
        "qwen2_sharded_bf16": t.Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": t.Qwen3Config(**COMMON, head_dim=16),
        "qwen3_yarn_bf16": t.Qwen3Config(**COMMON, head_dim=32, rope_parameters=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=10000.0)),
    }[name]


def _to_legacy(path):
    """Rewrite config.json the way transformers 4 spelled it: rope_scaling + top-level rope_theta."""
    with open(path / "config.json") as f:
        d = json.load(f)
    rope = d.pop("rope_parameters")
    d.update(rope_theta=rope["rope_theta"], rope_scaling={"type": rope["rope_type"], "factor": rope["factor"]},
             torch_dtype=d.pop("dtype"))
    (path / "config.json").write_text(json.dumps(d))


def _build(name, path):
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(name))
    with torch.no_grad():  # larger than HF's init, so log-probs are far from uniform
        for pname, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in pname else p.normal_(0.0, 0.15)
    if name.endswith("bf16"):
        model = model.to(torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="20KB" if "sharded" in name else "50GB")
    if "legacy" in name:
        _to_legacy(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: _build(name, root / name) for name in VARIANTS}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _right_padded(seed=0, lengths=(12, 9, 5)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, :n] = True
    return ids, mask, torch.arange(ids.shape[1]).expand_as(ids) + OFFSET


def _ours_logp(model, ids, mask, pos):
    with torch.no_grad():
        return torch.log_softmax(model.logits(model(ids, pos, mask)), -1)


def _hf_logp(model, ids, mask, pos):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits.float(), -1)


def _plain_rope(cfg):
    """``cfg`` with its rope scaling replaced by plain rope of the same theta."""
    extra = {k: v for k, v in cfg.extra.items() if k not in ("rope_scaling", "rope_parameters")}
    extra["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope()["rope_theta"]}
    return dataclasses.replace(cfg, extra=extra)


@pytest.mark.parametrize("name", VARIANTS)
def test_learner_logprobs_match_transformers(ckpt, name):
    ours, ref = load_pretrained(ckpt[name]).eval(), _hf(ckpt[name])
    batch = _right_padded()
    got, want = _ours_logp(ours, *batch), _hf_logp(ref, *batch)
    mask = batch[1]
    assert (got[mask] - want[mask]).abs().max() < 1e-5
    if ours.cfg.rope()["rope_type"] != "default":  # the scaling is exercised: ignoring it would show
        plain = Decoder.from_state(_plain_rope(ours.cfg), dict(ours.state_dict()))
        assert (_ours_logp(plain, *batch)[mask] - want[mask]).abs().max() > 1e-3


@pytest.mark.parametrize("name", VARIANTS)
def test_engine_logprobs_match_transformers(ckpt, name):
    """The actor's path (prefill + decode steps through the KV cache, left padding)."""
    engine = TorchEngine(load_pretrained(ckpt[name]), SamplingSpec(), eos_ids=[EOS], pad_id=0, max_new_tokens=6,
                         dtype="float32")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 3, 10)]
    samples = engine.generate(prompts, greedy=True)
    ref = _hf(ckpt[name])
    for prompt, sample in zip(prompts, samples):
        seq = torch.tensor([prompt + sample.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(ref(seq).logits[0].float(), -1)
        want = logp[len(prompt) - 1:-1].gather(-1, seq[0, len(prompt):, None]).squeeze(-1)
        assert len(sample.tokens) >= 1
        assert (torch.tensor(sample.logprobs) - want).abs().max() < 1e-5


ROPES = [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 5e5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 1e4,
     "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.25,
     "rope_theta": 1e4},
]


@pytest.mark.parametrize("rope", ROPES, ids=[f"{r['rope_type']}{i}" for i, r in enumerate(ROPES)])
def test_rope_frequencies_equal_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from model.rope import inv_freq, rope_parameters

    hf_cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                                      rope_parameters=dict(rope))
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], _hf_default)
    want, want_scale = init(hf_cfg)
    got, scale = inv_freq(rope_parameters({"rope_parameters": dict(rope)}, 131072), 128, 131072)
    assert torch.equal(got, want) and scale == pytest.approx(want_scale, rel=1e-12)


def _hf_default(hf_cfg):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_missing_keys_take_each_familys_transformers_default(model_type):
    minimal = {"vocab_size": VOCAB, "hidden_size": 256, "num_attention_heads": 64}  # llama kv: 64, qwen: 32
    ours, hf = ArchConfig.from_hf({"model_type": model_type, **minimal}), transformers.AutoConfig.for_model(
        model_type, **minimal)
    for key in ("num_key_value_heads", "intermediate_size", "num_hidden_layers", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.head_dim == (getattr(hf, "head_dim", None) or 256 // 64)  # qwen3: 128, not hidden/heads
    assert ours.rope() == dict(hf.rope_parameters)


def _config(path):
    with open(f"{path}/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("name", VARIANTS)
def test_saved_checkpoint_reloads_in_transformers(ckpt, name, tmp_path):
    src = ckpt[name]
    out = str(tmp_path / "out")
    save_pretrained(load_pretrained(src), out, tokenizer_files(src))
    before, after = _config(src), _config(out)
    dtype_keys = {"dtype", "torch_dtype"} & set(before)
    assert set(after) == set(before)  # the input's keys, no more, no fewer
    assert {k: v for k, v in after.items() if k not in dtype_keys} == {k: v for k, v in before.items()
                                                                       if k not in dtype_keys}
    assert dtype_keys and all(after[k] == "float32" for k in dtype_keys)  # FP32 written, FP32 said
    batch = _right_padded(seed=2)
    torch.testing.assert_close(_hf_logp(_hf(out), *batch), _hf_logp(_hf(src), *batch), rtol=0, atol=0)
    original = {k for p in Path(src).glob("*.safetensors") for k in load_file(p)}  # every shard's names
    assert set(load_file(f"{out}/model.safetensors")) == original  # a tied head is not written


def test_bf16_checkpoint_saves_bit_identical_in_bf16(ckpt, tmp_path):
    src = ckpt["qwen3_yarn_bf16"]
    save_pretrained(load_pretrained(src).to(torch.bfloat16), str(tmp_path))
    a, b = load_file(f"{src}/model.safetensors"), load_file(f"{tmp_path}/model.safetensors")
    assert a.keys() == b.keys() and all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    assert _config(tmp_path)["dtype"] == "bfloat16"


def test_sharded_load_logs_progress(ckpt, caplog):
    with caplog.at_level("INFO", logger="driftrl.hf"):
        load_pretrained(ckpt["qwen2_sharded_bf16"])
    shards = [r.getMessage() for r in caplog.records if " shard " in r.getMessage()]
    assert len(shards) > 1 and all(" MB in " in m for m in shards)


DELETE = object()
REFUSED = [  # (variant, config.json edits, what the message must name)
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
    ("llama_linear_legacy", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                              "long_factor": [1.0] * 8}}, "'longrope'"),
    ("qwen2_sharded_bf16", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                            "layer_types": DELETE}, "use_sliding_window=True"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
    ("qwen3", {"model_type": "mistral"}, "model_type='mistral'"),
    ("qwen3", {"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("qwen3", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("qwen3", {"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
    ("qwen3", {"intermediate_size": 96}, "wrong shapes.*mlp.down_proj.weight"),
    # transformers' default for all three families is untied: a tied model without the key needs lm_head
    ("qwen2_sharded_bf16", {"tie_word_embeddings": DELETE}, r"missing \['lm_head.weight'\]"),
    ("llama3", {"attention_bias": False}, "unexpected.*self_attn.k_proj.bias"),
]


@pytest.mark.parametrize("name,edits,message", REFUSED)
def test_unsupported_config_is_refused_naming_the_field(ckpt, tmp_path, name, edits, message):
    path = tmp_path / "m"
    shutil.copytree(ckpt[name], path)
    d = _config(path)
    for key, value in edits.items():
        d.pop(key, None) if value is DELETE else d.__setitem__(key, value)
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message):
        load_pretrained(str(path))


def test_missing_and_unexpected_tensors_are_named(ckpt, tmp_path):
    shutil.copytree(ckpt["llama3"], tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.bias")
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.bias'\].*extra.weight"):
        load_pretrained(str(tmp_path / "m"))


@pytest.mark.parametrize("name", VARIANTS)
def test_trains_a_few_steps_then_saves_for_transformers(ckpt, name, tmp_path):
    cfg = tiny_cfg("learner.body_dtype=float32", "actor.group_size=4", resolved=False)
    backend = TorchBackend(cfg, ckpt[name])
    engine = TorchEngine(load_pretrained(ckpt[name]), SamplingSpec(), eos_ids=[EOS], pad_id=0, max_new_tokens=5,
                         dtype="float32")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 4)]
    samples = engine.generate([p for p in prompts for _ in range(4)])
    batch = collate(groups_from_samples(prompts, samples, 4, rewards=[[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 0.0]]),
                    learner_version=0, vocab_size=VOCAB)
    before = {k: v.clone() for k, v in backend.named_tensors().items()}
    losses = [backend.step(batch)["learner/loss"] for _ in range(3)]
    after = backend.named_tensors()
    assert all(math.isfinite(x) for x in losses)
    assert [k for k in before if torch.equal(before[k], after[k])] == []  # every tensor trained
    backend.save_model(str(tmp_path / "out"))
    ids, mask, pos = _right_padded(seed=4)
    want = _ours_logp(backend.model.eval(), ids, mask, pos)
    got = _hf_logp(_hf(str(tmp_path / "out")), ids, mask, pos)
    assert (got[mask] - want[mask]).abs().max() < 1e-5
