"""The GPU check never passes for a machine that cannot run it: a requested step that cannot run
is a FAIL naming the step, and the exit status is 1."""

import pytest
import torch

from bench import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check may pass")
def test_without_cuda_the_check_fails_and_says_why(tmp_path):
    log = tmp_path / "gpu.log"
    assert gpu_check.main([str(log)]) == 1
    assert gpu_check.main([str(log), "--device", "cpu"]) == 1
    assert log.read_text().startswith("GPU_CHECK FAIL: needs a CUDA device")


def test_a_step_that_cannot_run_is_a_failure(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(gpu_check, "_has_cupy", lambda: False)
    assert gpu_check.step_nccl_publisher(cpu, {}) == ("FAIL", "(cupy not installed)")
    assert gpu_check.step_buckets(cpu, {"named": {}, "header": None}) == ("FAIL", "(cupy not installed)")
    status, detail = gpu_check.step_nccl_two_gpus(cpu, {})
    if torch.cuda.device_count() < 2:
        assert status == "FAIL" and "needs 2 GPUs" in detail


def test_without_cupy_the_check_exits_1_and_names_the_steps(tmp_path, monkeypatch, capsys):
    # run the steps on the CPU (shm and fs really run there), as if CUDA were present
    monkeypatch.setattr(gpu_check, "_has_cupy", lambda: False)
    monkeypatch.setattr(gpu_check, "cuda_problem", lambda device: None)
    log = tmp_path / "gpu.log"
    assert gpu_check.main([str(log), "--device", "cpu", "--steps", "env,layout,buckets,nccl-pub,shm,fs"]) == 1
    lines = log.read_text().splitlines()
    assert lines[-1] == "GPU_CHECK FAIL: ['buckets', 'nccl-pub']"
    assert [ln.split()[0] for ln in lines[:-1]] == ["OK", "OK", "FAIL", "FAIL", "OK", "OK"]
    assert all("cupy not installed" in ln for ln in lines if ln.startswith("FAIL"))
    assert "GPU_CHECK FAIL" in capsys.readouterr().out


def test_cuda_ipc_and_two_gpu_steps_fail_where_they_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "cuda_problem", lambda device: None)
    log = tmp_path / "gpu.log"
    steps = "cuda-ipc" if torch.cuda.device_count() >= 2 else "cuda-ipc,nccl-2gpu"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: cuda-ipc may pass (tests/gpu runs it)")
    assert gpu_check.main([str(log), "--device", "cpu", "--steps", steps]) == 1
    text = log.read_text()
    assert text.splitlines()[-1] == f"GPU_CHECK FAIL: {steps.split(',')}"
    assert "learner.device" in text  # cuda_ipc on host memory says what to set


def test_unknown_steps_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.main(["/dev/null", "--steps", "env,warp-drive"])
    assert gpu_check._steps("all")[-1] == "nccl-2gpu" and "nccl-2gpu" not in gpu_check._steps("default")


def test_the_cuda_ipc_verdict_needs_every_version_bit_exact():
    n, cpu = gpu_check.IPC_VERSIONS, torch.device("cpu")
    good = {"applied": list(range(n)), "exact": n, "apply_s": [1e-3] * n}
    status, detail = gpu_check._ipc_verdict(good, [1e-3] * n, 1 << 20, cpu, 0)
    fields = dict(f.split("=") for f in detail.split())
    assert status == "OK" and fields["exact"] == f"{n}/{n}" and float(fields["ratio"]) > 0
    assert float(fields["apply_ratio"]) > float(fields["ratio"])  # one copy against two
    assert gpu_check._ipc_verdict({**good, "exact": n - 1}, [1e-3] * n, 1 << 20, cpu, 0)[0] == "FAIL"
    assert gpu_check._ipc_verdict({**good, "applied": [0, 2]}, [1e-3] * n, 1 << 20, cpu, 0)[0] == "FAIL"
    assert gpu_check._ipc_verdict(good, [1e-3] * n, 1 << 20, cpu, 1)[0] == "FAIL"  # the reader crashed after
