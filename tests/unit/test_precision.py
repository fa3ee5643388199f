"""The `auto` precision policy (core/precision.py): BF16 where the device computes it natively."""

import torch

from core import config as C
from core import precision
from model.decoder import body_autocast

AVX2_ONLY = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512_bf16"}
AMX = AVX2_ONLY | {"avx512f", "amx_tile", "amx_bf16"}


def test_cpu_without_native_bf16_gets_fp32_and_says_why():
    dtype, why = precision.choose("auto", "cpu", AVX2_ONLY)
    assert dtype == "float32" and "no native BF16" in why


def test_cpu_with_avx512_bf16_or_amx_gets_bf16_naming_the_flag():
    assert precision.choose("auto", "cpu", AVX512_BF16) == ("bfloat16", "auto: this CPU computes BF16 natively (avx512_bf16)")
    dtype, why = precision.choose("auto", "cpu", AMX)
    assert dtype == "bfloat16" and "amx_bf16" in why


def test_cuda_gets_bf16_and_an_explicit_dtype_always_wins():
    assert precision.choose("auto", "cuda:0", frozenset())[0] == "bfloat16"
    for explicit in ("float32", "bfloat16", "float16"):
        assert precision.choose(explicit, "cpu", AVX2_ONLY) == (explicit, "set explicitly")
        assert precision.choose(explicit, "cuda:1", AMX)[0] == explicit


def test_this_machines_flags_are_read_from_proc_cpuinfo():
    flags = precision.cpu_flags()
    with open("/proc/cpuinfo") as f:
        line = next(ln for ln in f if ln.startswith("flags"))
    assert flags == frozenset(line.split(":", 1)[1].split()) and "sse2" in flags


def test_resolve_writes_concrete_dtypes_and_the_note_into_the_config():
    cfg = C.load(None, [])
    assert cfg.actor.dtype == cfg.learner.body_dtype == "auto"  # the default
    out, note = precision.resolve(cfg, "cpu", ["cpu"])
    want = precision.choose("auto", "cpu")[0]
    assert out.actor.dtype == out.learner.body_dtype == want
    assert out.run.precision_note == note and f"learner.body_dtype={want}" in note
    assert C.from_json(C.to_json(out)).run.precision_note == note  # written to config.json, read back
    forced, _ = precision.resolve(C.load(None, ['learner.body_dtype="bfloat16"']), "cpu", ["cpu"])
    assert forced.learner.body_dtype == "bfloat16"
    mixed, _ = precision.resolve(cfg, "cpu", ["cpu", "cuda:0"])
    assert mixed.actor.dtype == "auto"  # each engine resolves for its own device


def test_body_autocast_auto_follows_the_choice():
    with body_autocast("auto", "cpu"):
        y = torch.ones(4, 4) @ torch.ones(4, 4)
    assert y.dtype == getattr(torch, precision.choose("auto", "cpu")[0])
