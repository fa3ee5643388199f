"""The GPU path: the one-GPU device check, CUDA IPC between two processes on one device,
engine and learner on CUDA, and NCCL (cupy) between two GPUs.

Marked ``gpu``: skipped without CUDA (tests/conftest.py); the two-GPU test also needs cupy.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

N_VERSIONS = 5


def _state(version: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "embed": torch.randn(1000, 64, generator=g).bfloat16().to(device),
        "q": torch.randn(64, 64, generator=g).to(device),
        "norm": torch.full((64,), float(version)).to(device),
        "step": torch.tensor([version], dtype=torch.int64).to(device),
        "mlp": torch.randn(2048, 512, generator=g).to(device),  # > 1 MiB: its own bucket
    }


def _subscriber_proc(run_dir: str, out_path: str) -> None:
    from weightsync.nccl import NcclSubscriber

    torch.cuda.set_device(1)
    dev = torch.device("cuda", 1)
    sub = NcclSubscriber(run_dir, timeout_s=60, device=dev, collective_timeout_s=60)  # its own device
    # float32 targets for the bfloat16 embedding: apply converts on the device
    target = {k: torch.zeros(v.shape, dtype=torch.float32 if k == "embed" else v.dtype, device=dev)
              for k, v in _state(0, "cpu").items()}
    applied, bad = [], []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not applied or applied[-1] < N_VERSIONS - 1):
        if sub.latest_version() > sub.stats.last_version:
            v = sub.apply(target)
            applied.append(v)
            want = _state(v, dev)
            if not all(torch.equal(target[k], want[k].to(target[k].dtype)) for k in want):
                bad.append(v)
        else:
            time.sleep(1e-3)
    with open(out_path, "w") as f:
        json.dump({"applied": applied, "bad": bad, "rank": sub.rank}, f)
    sub.close()


def test_gpu_check_script(tmp_path):
    from bench.gpu_check import main

    log = tmp_path / "gpu_check.log"
    rc = main([str(log), "--device", "cuda"])
    text = log.read_text()
    assert rc == 0, text
    assert text.strip().splitlines()[-1].startswith("GPU_CHECK PASS")


def test_cuda_ipc_between_two_processes_is_bit_exact():
    from bench.gpu_check import step_cuda_ipc

    status, detail = step_cuda_ipc(torch.device("cuda:0"), {"ipc_mb": 32})
    assert status == "OK", detail
    assert "exact=4/4" in detail


def test_engine_and_learner_on_cuda_pass_the_contract_check():
    """What run.py checks before a run, on the device: same weights, same tokens, log-probs agree."""
    from actor.engines.torch import TorchEngine
    from learner import contract
    from learner.backends.torch import TorchBackend
    from model.sampling import SamplingSpec
    from tests.support.tiny import tiny_cfg, tiny_model, tiny_model_dir, tiny_task, tiny_tokenizer

    cfg = tiny_cfg('learner.device="cuda:0"', 'actor.device="cuda:0"')
    backend = TorchBackend(cfg, tiny_model_dir())
    assert next(backend.model.parameters()).device == torch.device("cuda:0")
    tok = tiny_tokenizer()
    engine = TorchEngine(tiny_model(), SamplingSpec.of(cfg.actor), eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                         max_new_tokens=8, dtype="bfloat16", device="cuda:0")
    report = contract.check(backend, engine, tiny_task(), SamplingSpec.of(cfg.actor), 0.1, 0.01)
    assert report["tokens"] > 0
    assert engine._cache.k[0].device == torch.device("cuda:0")
    assert all(t.device == torch.device("cuda:0") for t in backend.named_tensors().values())


def test_nccl_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("cupy")
    from weightsync.nccl import NcclPublisher

    run_dir = str(tmp_path / "run")
    out = str(tmp_path / "sub.json")
    p = mp.get_context("spawn").Process(target=_subscriber_proc, args=(run_dir, out), daemon=True)
    p.start()
    try:
        torch.cuda.set_device(0)
        pub = NcclPublisher(run_dir, _state(0, "cuda:0"), bucket_bytes=1 << 20, world_size=2,
                            join_timeout_s=120, collective_timeout_s=60)
        assert len(pub.header.buckets) >= 3
        for v in range(N_VERSIONS):
            stats = pub.publish(v, _state(v, "cuda:0"))
            assert stats.bytes == sum(t.nbytes for t in _state(0, "cpu").values())
        p.join(120)
        pub.close()
        assert p.exitcode == 0
        r = json.load(open(out))
        assert r["rank"] == 1 and r["bad"] == []
        assert r["applied"][-1] == N_VERSIONS - 1
        assert all(a < b for a, b in zip(r["applied"], r["applied"][1:]))
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
