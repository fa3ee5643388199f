"""The Megatron-core backend: :class:`TorchBackend` (loss, micro-batching, AdamW, metrics, checkpoints,
through its hooks) with megatron-core's GPTModel as the body, HF weights converted in and out,
transformers' rotary frequencies, the head through ``token_logprobs``. Off FP32 it computes as on a
GPU (body-dtype residual stream and cos/sin): max |dlogp| ~0.03 against the FP32 torch backend, as
the torch backend's own BF16 body; in FP32 they agree to float noise. CPU only (``megatron_cpu.py``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core import precision
from core.config import ConfigError
from learner.backends.torch import TorchBackend
from model.attention import DTYPES, body_autocast
from model.decoder import ArchConfig, Decoder
from model.hf import load_pretrained
from model.rope import inv_freq

with warnings.catch_warnings():
    # the local spec is chosen on purpose: megatron's notes that TE and Apex are absent are noise
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor
    from megatron.core.transformer.transformer_config import TransformerConfig

    from learner.backends import megatron_cpu

DEVICE = torch.device("cpu")


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """The fields megatron's attention reads (``hasattr``) to scale YaRN's cos/sin."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None


def _yarn_fields(arch: ArchConfig) -> dict:
    """megatron's YaRN fields for ``arch`` ({} for other rope types)."""
    p = arch.rope()
    if p["rope_type"] != "yarn":
        return {}
    _, scale = inv_freq(p, arch.head_dim, arch.max_position_embeddings)
    factor = p.get("factor") or arch.max_position_embeddings / p["original_max_position_embeddings"]
    both = bool(p.get("mscale") and p.get("mscale_all_dim"))  # transformers' rule for using them
    fields = dict(yarn_rotary_scaling_factor=float(factor), yarn_mscale=p.get("mscale") if both else None,
                  yarn_mscale_all_dim=p.get("mscale_all_dim") if both else None)
    theirs = _yarn_get_concentration_factor(*fields.values())
    if theirs != scale:
        raise ValueError(f"config.json rope attention_factor={p.get('attention_factor')!r} (cos/sin scale {scale}) "
                         f"is not supported by learner.backend='megatron': megatron-core derives the YaRN scale "
                         f"from factor/mscale/mscale_all_dim, here {theirs}; use learner.backend='torch'")
    return fields


def core_config(arch: ArchConfig, lc) -> TransformerConfig:
    body = precision.dtype_name(lc.body_dtype, DEVICE)
    yarn = _yarn_fields(arch)
    return (YarnTransformerConfig if yarn else TransformerConfig)(
        num_layers=arch.num_hidden_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim, normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, qk_layernorm=arch.qk_norm,
        # one switch for o_proj's and the MLP's biases: built with either, _drop_absent_biases trims
        add_qkv_bias=arch.qkv_bias, add_bias_linear=arch.o_bias or arch.mlp_bias,
        hidden_dropout=0.0, attention_dropout=0.0,  # megatron_cpu's no-op RNG tracker relies on it
        attention_softmax_in_fp32=lc.fp32_attn_softmax, bf16=body == "bfloat16", fp16=body == "float16",
        params_dtype=torch.float32, enable_autocast=body != "float32", autocast_dtype=DTYPES[body],
        use_cpu_initialization=True, perform_initialization=False,  # weights come from the checkpoint
        rotary_interleaved=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, cuda_graph_scope=[], **yarn)  # [] = its default "full", undeprecated


def _drop_absent_biases(model: GPTModel, arch: ArchConfig) -> None:
    """Llama switches attention and MLP biases separately, megatron cannot: built with their union,
    the biases the checkpoint lacks become None, as megatron's own ``bias=False`` leaves them."""
    keep = {"linear_qkv": arch.qkv_bias, "linear_proj": arch.o_bias, "linear_fc1": arch.mlp_bias,
            "linear_fc2": arch.mlp_bias}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not keep.get(leaf, True) and getattr(module, "bias", None) is not None:
            module.register_parameter("bias", None)


class IslandDotProductAttention(DotProductAttention):
    """megatron's attention with ``model/decoder.py``'s FP32 island (ARCHITECTURE.md: Precision and the ratio) when
    ``attention_softmax_in_fp32``: q, k, v enter upcast (exact) with autocast off, the output is rounded once."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if config.attention_softmax_in_fp32:
            self.scale_mask_softmax.input_in_float16 = False  # FP32 scores in, FP32 probabilities out

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if not self.config.attention_softmax_in_fp32:
            return super().forward(query, key, value, attention_mask, *args, **kwargs)
        with torch.autocast(query.device.type, enabled=False):
            out = super().forward(query.float(), key.float(), value.float(), attention_mask, *args, **kwargs)
        return out.to(value.dtype)


def build_gpt(arch: ArchConfig, lc) -> GPTModel:
    """An uninitialised FP32 GPTModel of ``arch`` on the CPU."""
    megatron_cpu.init_host(DEVICE)
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = IslandDotProductAttention
    model = GPTModel(core_config(arch, lc), spec, vocab_size=arch.vocab_size,
                     max_sequence_length=arch.max_position_embeddings, position_embedding_type="rope",
                     share_embeddings_and_output_weights=arch.tie_word_embeddings)
    _drop_absent_biases(model, arch)
    model.rotary_pos_emb = megatron_cpu.HostRotaryEmbedding(kv_channels=arch.head_dim, rotary_percent=1.0,
                                                            use_cpu_initialization=True)
    model.rotary_pos_emb.inv_freq = inv_freq(arch.rope(), arch.head_dim, arch.max_position_embeddings)[0]
    megatron_cpu.host_linears(model)
    return model


# one decoder layer's rows: (megatron name, the HF names it holds, the ArchConfig switch it needs)
LAYER_ROWS = (
    ("input_layernorm.weight", ("input_layernorm.weight",), None),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), None),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), None),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), None),
    ("self_attention.linear_qkv.weight", tuple(f"self_attn.{x}_proj.weight" for x in "qkv"), None),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), None),
    ("self_attention.linear_qkv.bias", tuple(f"self_attn.{x}_proj.bias" for x in "qkv"), "qkv_bias"),
    ("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), "o_bias"),
    ("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), "mlp_bias"),
    ("mlp.linear_fc2.bias", ("mlp.down_proj.bias",), "mlp_bias"),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "qk_norm"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "qk_norm"),
)


def param_rows(arch: ArchConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(megatron parameter, the HF tensors it holds): one HF name is a copy, two are gate/up
    stacked (``linear_fc1``), three are q/k/v interleaved per query group (``linear_qkv``)."""
    rows = [("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
            ("decoder.final_layernorm.weight", ("model.norm.weight",))]
    for i in range(arch.num_hidden_layers):
        rows += [(f"decoder.layers.{i}.{name}", tuple(f"model.layers.{i}.{h}" for h in hf))
                 for name, hf, switch in LAYER_ROWS if switch is None or getattr(arch, switch)]
    if not arch.tie_word_embeddings:
        rows.append(("output_layer.weight", ("lm_head.weight",)))
    return rows


def _fuse(arch: ArchConfig, parts: list[torch.Tensor]) -> torch.Tensor:
    if parts[0].dim() == 0:  # AdamW's step count: one per parameter, equal for the parts
        return parts[0]
    if len(parts) != 3:
        return torch.cat(parts)  # [gate; up] rows (mlp.py: chunk(2) -> silu(first) * second)
    # megatron's linear_qkv rows, per query group g: its q heads, then k_g, then v_g
    # (attention.py get_query_key_value_tensors: [ng, (np/ng + 2) * hn])
    g, tail = arch.num_key_value_heads, parts[0].shape[1:]
    return torch.cat([t.reshape(g, -1, *tail) for t in parts], dim=1).reshape(-1, *tail)


def _split(arch: ArchConfig, t: torch.Tensor, n: int) -> list[torch.Tensor]:
    if n == 1 or t.dim() == 0:  # a copy, or AdamW's step count (equal for the parts)
        return [t] * n
    if n == 2:
        return list(t.chunk(2))
    hd, tail = arch.head_dim, t.shape[1:]
    grouped = t.reshape(arch.num_key_value_heads, -1, *tail)  # per query group: its q heads, k_g, v_g
    return [p.reshape(-1, *tail) for p in grouped.split((grouped.shape[1] - 2 * hd, hd, hd), dim=1)]


def from_hf(arch: ArchConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> megatron's; rows whose tensors are all absent are skipped (optimiser
    state exists only for stepped parameters; weights are checked by the strict loads)."""
    return {name: _fuse(arch, [hf[s] for s in sources]) for name, sources in param_rows(arch)
            if any(s in hf for s in sources)}


def to_hf(arch: ArchConfig, mc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-named tensors -> HF names, in the HF state_dict order (Decoder's)."""
    found = {}
    for name, targets in param_rows(arch):
        if name in mc:
            found.update(zip(targets, _split(arch, mc[name], len(targets))))
    return {k: found[k] for k in Decoder.shapes(arch) if k in found}


class MegatronBackend(TorchBackend):
    name = "megatron"

    def _place(self):
        if self.cfg.learner.checkpoint_layers:
            raise ConfigError("learner.checkpoint_layers is the torch backend's; learner.backend='megatron' keeps "
                              "every layer's activations")
        if self.cfg.learner.device not in ("auto", "cpu"):
            raise ConfigError(f"learner.device={self.cfg.learner.device!r}: learner.backend='megatron' runs on the "
                              "CPU here (its CPU shim); use learner.backend=torch for a CUDA learner")
        return DEVICE

    def _build_model(self, model_dir: str, model):
        decoder = model if model is not None else load_pretrained(model_dir)
        self.arch = decoder.cfg  # the checkpoint's config: conversions and save_model's config.json
        gpt = build_gpt(self.arch, self.cfg.learner)
        gpt.load_state_dict(from_hf(self.arch, {k: v.float() for k, v in decoder.state_dict().items()}),
                            strict=True)
        return gpt.train()

    def _frozen_copy(self) -> GPTModel:
        # a GPTModel holds process groups, which cannot be deep-copied: build another, load the weights
        ref = build_gpt(self.arch, self.cfg.learner)
        ref.load_state_dict(self.model.state_dict(), strict=True)
        return ref.eval().requires_grad_(False)

    def _hidden(self, model: GPTModel, ids, key_mask):
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        masked = ~(causal[None, None] & key_mask[:, None, None, :])  # [N, 1, T, T], True = masked out
        with body_autocast(self.cfg.learner.body_dtype, DEVICE.type):
            x = model.embedding(input_ids=ids, position_ids=None)  # [T, N, H]; rope, no learned positions
            h = model.decoder(hidden_states=x, attention_mask=masked, rotary_pos_emb=model.rotary_pos_emb(t))
        return h.transpose(0, 1)

    def _head_weight(self, model: GPTModel):
        # not shared_embedding_or_output_weight(): on a first pipeline stage it is the embedding, tied or not
        tied = self.arch.tie_word_embeddings
        return model.embedding.word_embeddings.weight if tied else model.output_layer.weight

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return to_hf(self.arch, {k: v.detach() for k, v in self.model.named_parameters()})

    def _load_weights(self, state: dict) -> None:
        self.model.load_state_dict(from_hf(self.arch, state), strict=True)

    # AdamW's state is stored per HF tensor, as TorchBackend's: a checkpoint of either resumes in the other
    def _optim_state(self) -> dict:
        return relabel(self.opt.state_dict(), self._names(), list(Decoder.shapes(self.arch)),
                       lambda named: to_hf(self.arch, named))

    def _load_optim_state(self, sd: dict) -> None:
        self.opt.load_state_dict(relabel(sd, list(Decoder.shapes(self.arch)), self._names(),
                                         lambda named: from_hf(self.arch, named)))

    def _names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]


def relabel(sd: dict, src: list[str], dst: list[str], convert) -> dict:
    """An optimiser state_dict over the parameters named ``src`` (by index) -> one over ``dst``;
    ``convert`` maps ``{src name: tensor}`` to ``{dst name: tensor}`` (one state key at a time)."""
    if len(sd["param_groups"]) != 1:
        raise ValueError(f"expected one optimiser param group, got {len(sd['param_groups'])}")
    by_key: dict[str, dict] = {}
    for idx, state in sd["state"].items():
        for key, t in state.items():
            by_key.setdefault(key, {})[src[int(idx)]] = t
    index = {name: i for i, name in enumerate(dst)}
    out: dict[int, dict] = {}
    for key, named in by_key.items():
        for name, t in convert(named).items():
            out.setdefault(index[name], {})[key] = t
    groups = [{**sd["param_groups"][0], "params": list(range(len(dst)))}]
    return {"state": dict(sorted(out.items())), "param_groups": groups}
