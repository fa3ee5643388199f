"""What a checkpoint's config.json says, and whether the decoder runs it exactly: whatever it would only
approximate is refused before any weight is read. One :class:`Family` per ``model_type``; keys not parsed stay
in ``extra``, so :meth:`ArchConfig.to_hf` writes back exactly the input's keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.rope import rope_parameters

COMMON_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
               "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Family:
    architecture: str
    qk_norm: bool  # RMSNorm over each head's q and k before rope (Qwen3)
    fixed_qkv_bias: bool  # q/k/v biases always and o_proj none, whatever attention_bias says (Qwen2)
    keys: tuple[str, ...]  # the config keys parsed into ArchConfig fields; all others stay in `extra`
    defaults: dict  # transformers' values for those keys when config.json omits them
    sliding: bool  # the config class has use_sliding_window / layer_types (refused when in use)


_QWEN_SIZES = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=32, head_dim=None, max_position_embeddings=32768,
                   bos_token_id=None, eos_token_id=None)
_COMMON_DEFAULTS = dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=None)

FAMILIES = {
    "llama": Family("LlamaForCausalLM", qk_norm=False, fixed_qkv_bias=False,
                    keys=(*COMMON_KEYS, "attention_bias", "mlp_bias"), sliding=False,
                    defaults=dict(_COMMON_DEFAULTS, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                                  head_dim=None, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                  attention_bias=False, mlp_bias=False)),
    "qwen2": Family("Qwen2ForCausalLM", qk_norm=False, fixed_qkv_bias=True, keys=COMMON_KEYS, sliding=True,
                    defaults=dict(_COMMON_DEFAULTS, **_QWEN_SIZES)),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, fixed_qkv_bias=False, keys=(*COMMON_KEYS, "attention_bias"),
                    sliding=True, defaults=_COMMON_DEFAULTS | _QWEN_SIZES | {"head_dim": 128, "attention_bias": False}),
}


def family(model_type) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported: driftrl runs {sorted(FAMILIES)}")
    return FAMILIES[model_type]


@dataclass
class ArchConfig:
    vocab_size: int
    hidden_size: int  # the sizes have no defaults: from_hf reads them, the tiny builder passes them
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0  # the top-level key; a theta inside rope_scaling/rope_parameters wins
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # the built-in tiny model's; from_hf applies each family's default
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = "qwen3"
    attention_bias: bool = False
    mlp_bias: bool = False
    extra: dict = field(default_factory=dict)  # other HF keys, written back untouched
    source_keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)  # from_hf's input keys

    def __post_init__(self):
        fam = family(self.model_type)
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config.json num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if fam.fixed_qkv_bias and self.attention_bias:
            raise ValueError("qwen2 has no attention_bias switch (its q/k/v biases are always on)")
        self.rope()  # refuse an unsupported rope here, not when the model is built

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.model_type].qk_norm

    @property
    def qkv_bias(self) -> bool:
        return FAMILIES[self.model_type].fixed_qkv_bias or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and not FAMILIES[self.model_type].fixed_qkv_bias

    def rope(self) -> dict:
        """The effective rope settings (``rope_type``, ``rope_theta``, the type's keys)."""
        return rope_parameters({**self.extra, "rope_theta": self.rope_theta}, self.max_position_embeddings)

    def to_hf(self, dtype: str | None = None) -> dict:
        """The config.json to write: exactly the input's keys (built here: a complete one), ``dtype``
        in whichever of ``dtype`` / ``torch_dtype`` the input used (else both)."""
        fam = FAMILIES[self.model_type]
        if self.source_keys is None:
            own = {"architectures": [fam.architecture], "hidden_act": "silu", "attention_dropout": 0.0,
                   "use_cache": True, **({"use_sliding_window": False} if fam.sliding else {}),
                   **{k: getattr(self, k) for k in fam.keys}}
        else:  # no key the input lacked: a top-level rope_theta beside rope_parameters' own would mislead
            own = {k: getattr(self, k) for k in fam.keys if k in self.source_keys}
        out = {**own, **self.extra}
        keys = [k for k in ("dtype", "torch_dtype") if k in self.extra] or ["dtype", "torch_dtype"]
        return out if dtype is None else out | dict.fromkeys(keys, dtype)

    @classmethod
    def from_hf(cls, d: dict) -> "ArchConfig":
        fam = family(d.get("model_type"))
        _refuse_unsupported(d, fam)
        known = {**fam.defaults, **{k: d[k] for k in fam.keys if k in d}}
        if known["num_key_value_heads"] is None:
            known["num_key_value_heads"] = known["num_attention_heads"]
        if known["head_dim"] is None:
            known["head_dim"] = known["hidden_size"] // known["num_attention_heads"]
        if known["rope_theta"] is None:
            known["rope_theta"] = fam.defaults["rope_theta"]
        return cls(**known, extra={k: v for k, v in d.items() if k not in fam.keys}, source_keys=tuple(d))


def _refuse_unsupported(d: dict, fam: Family) -> None:
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json hidden_act={act!r} is not supported: driftrl's MLP is SwiGLU (silu)")
    if d.get("attention_dropout") not in (None, 0, 0.0):
        raise ValueError(f"config.json attention_dropout={d['attention_dropout']!r} is not supported: "
                         "the learner trains without dropout")
    if d.get("quantization_config") is not None:
        method = (d["quantization_config"] or {}).get("quant_method")
        raise ValueError(f"config.json quantization_config (quant_method={method!r}): quantised checkpoints "
                         "are not supported; use BF16/FP16/FP32 weights")
    if fam.sliding:
        _refuse_sliding(d)


def _refuse_sliding(d: dict) -> None:
    """Layers slide when layer_types says so, or else from max_window_layers on with use_sliding_window."""
    kinds = d.get("layer_types")
    if kinds:
        if sliding := [i for i, kind in enumerate(kinds) if kind != "full_attention"]:
            raise ValueError(f"config.json layer_types={kinds!r}: layers {sliding} are not full attention; "
                             "sliding-window attention is not supported")
        return
    first, layers = d.get("max_window_layers", 28), d.get("num_hidden_layers", 32)
    if d.get("use_sliding_window") and (window := d.get("sliding_window", 4096)) is not None and first < layers:
        raise ValueError(f"config.json use_sliding_window=True (sliding_window={window}, max_window_layers={first} "
                         f"< num_hidden_layers={layers}): sliding-window attention is not supported")
