"""Our Qwen3 module must match transformers' implementation on the same HF checkpoint."""

import dataclasses

import pytest
import torch

from model.decoder import ArchConfig, Qwen3
from model.kvcache import KVCache
from model.hf import load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")


def _tiny(tmp_path, tie=True):
    torch.manual_seed(0)
    cfg = ArchConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)
    m = Qwen3(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    save_pretrained(m, str(tmp_path))
    return m


@pytest.mark.parametrize("tie", [True, False])
def test_matches_transformers(tmp_path, tie):
    ours = _tiny(tmp_path, tie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 40, (3, 11))
    pos = torch.arange(11).expand(3, 11)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.logits(ours(ids, pos, torch.ones(3, 11, dtype=torch.bool)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_kv_cache_left_padding_matches_full_forward(tmp_path):
    m = _tiny(tmp_path).eval()
    torch.manual_seed(1)
    seqs = [torch.randint(1, 40, (n,)) for n in (5, 8, 3)]
    width = 8
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = True
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(m.cfg, 3, width + 4, torch.float32)
    nxt = torch.randint(1, 40, (3, 4))
    with torch.no_grad():
        h = m(ids, pos, mask, cache)
        outs = [m.logits(h[:, -1])]
        for j in range(4):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], 1)
            pos = pos[:, -1:] + 1
            outs.append(m.logits(m(nxt[:, j:j + 1], pos, mask, cache)[:, -1]))
        for i, s in enumerate(seqs):
            full = torch.cat([s, nxt[i]])
            ref = m.logits(m(full[None], torch.arange(len(full))[None], torch.ones(1, len(full), dtype=torch.bool)))[0]
            for j in range(5):
                torch.testing.assert_close(outs[j][i], ref[len(s) - 1 + j], rtol=1e-4, atol=1e-4)


def test_round_trip_and_mismatch_error(tmp_path):
    m = _tiny(tmp_path)
    m2 = load_pretrained(str(tmp_path))
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_pretrained(str(tmp_path))


def test_built_in_config_is_a_tied_qwen3_and_round_trips():
    """The direct-construction path (model/basemodel.py's tiny model) stays a tied Qwen3, and its
    config.json -- today's and the one written before families existed -- parses back to it."""
    cfg = ArchConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=3)
    keys = set(Qwen3(cfg).state_dict())
    assert "model.layers.0.self_attn.q_norm.weight" in keys and "lm_head.weight" not in keys
    assert not any(k.endswith(".bias") for k in keys)
    hf = cfg.to_hf("float32")
    assert (hf["model_type"], hf["architectures"], hf["tie_word_embeddings"]) == ("qwen3", ["Qwen3ForCausalLM"], True)
    assert hf["dtype"] == hf["torch_dtype"] == "float32"
    written_before = {**{k: v for k, v in hf.items() if k not in ("dtype", "extra")}, "rope_scaling": None,
                      "attention_bias": False, "use_sliding_window": False}
    for d in (hf, written_before):
        back = ArchConfig.from_hf(d)
        assert dataclasses.replace(back, extra={}) == cfg  # every field (source_keys is not compared)
        assert back.to_hf() == d  # every key written back as read


def test_rope_frequencies_stay_fp32_when_the_weights_are_cast():
    m = Qwen3(ArchConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    inv = m.rotary.inv_freq.clone()
    m.to(torch.bfloat16)
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert m.rotary.inv_freq.dtype == torch.float32 and torch.equal(m.rotary.inv_freq, inv)
    m.double()  # an upcast still applies (float64 references)
    assert m.rotary.inv_freq.dtype == torch.float64
