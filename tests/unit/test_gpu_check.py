"""The GPU check never passes for a machine that cannot run it."""

import pytest
import torch

from weightsync import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check may pass")
def test_without_cuda_the_check_fails_and_says_why(tmp_path):
    log = tmp_path / "gpu.log"
    assert gpu_check.main([str(log)]) == 1
    assert gpu_check.main([str(log), "--device", "cpu"]) == 1
    assert log.read_text().startswith("GPU_CHECK FAIL: needs a CUDA device")


def test_a_step_that_cannot_run_is_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "_has_cupy", lambda: False)
    assert gpu_check.step_nccl_publisher(torch.device("cpu"), {})[0] == "FAIL"
    assert gpu_check.step_buckets(torch.device("cpu"), {"named": {}, "header": None})[0] == "FAIL"
