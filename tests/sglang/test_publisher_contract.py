"""Contract of the learner's ``backend="torch_dist"`` publisher (weightsync/nccl.py) with SGLang 0.5.23's
own receiver, on CPU (Gloo where GPUs use NCCL; nothing else differs).

driftrl's real ``NcclPublisher`` is rank 0. In a child process the SGLang engine's real
``GroupLink`` gets its rank, and SGLang's own model-runner ``WeightUpdater`` receives: its
``init_weights_update_group`` (``init_custom_process_group``) joins with the link's
``/init_weights_update_group`` body, its ``receive_weights_from_distributed`` takes each
``/update_weights_from_distributed`` body of ``bucket_bodies`` (``load_format="flattened_bucket"``,
a ``FlattenedTensorBucket`` receive), both bodies parsed into SGLang's own request structs as its FastAPI app parses them. Then
SGLang's ``destroy_weights_update_group`` and a repeat Hello (a restarted server): the publisher
rebuilds the group, and the version after it lands through SGLang's code again. Every tensor of
every version is compared bit for bit.

Runs in the SGLang venv (``.ci/sglang-contract``); skips where SGLang is not importable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")

import torch  # noqa: E402

from tests.support.weights import random_weights  # noqa: E402
from weightsync.nccl import NcclPublisher  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = [("embed", torch.bfloat16, [24, 8]), ("l0.q", torch.float32, [8, 8]), ("l0.norm", torch.float32, [8]),
         ("l1.q", torch.bfloat16, [8, 8]), ("head", torch.float16, [8, 6])]
PHASES = [[1, 2], [3]]  # versions received through the first group, then through the rebuilt one

SERVER = r"""
import json, sys, time
import pydantic
import tests.sglang.conftest  # noqa: F401  (torchvision on a CPU torch)
import torch
from safetensors.torch import save_file
from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
from sglang.srt.utils.network import get_free_port
from actor.engines.sglang import bucket_bodies, join_body
from weightsync.nccl import GroupLink

args = json.loads(sys.argv[1])
parse = lambda body, cls: pydantic.TypeAdapter(cls).validate_json(json.dumps(body))  # as FastAPI builds it
# the server's own default group (init_weights_update_group asserts one): one rank, its own store
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{get_free_port()}", rank=0, world_size=1)
unused = lambda *a, **k: None
runner = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                       get_model=unused, update_model_fields=unused, recapture_cuda_graph=unused,
                       get_model_runner=unused)
link = GroupLink(args["run_dir"], timeout_s=60, actor_id="actor-0")
got, joins = {}, []
for i, versions in enumerate(args["phases"]):
    if i:
        open(args["out"] + ".rejoin", "w").close()  # the test waits for this Hello before publishing
    body = join_body(link.join())
    joins.append(body)
    req = parse({**body, "backend": "gloo"}, InitWeightsUpdateGroupReqInput)  # nccl on GPUs
    ok, msg = runner.init_weights_update_group(req.master_address, req.master_port, req.rank_offset,
                                               req.world_size, req.group_name, req.backend)
    assert ok, msg
    for v in versions:
        deadline = time.monotonic() + 60
        while link.latest_version() < v and time.monotonic() < deadline:
            time.sleep(0.005)
        header = link.pending.pop(0)
        assert header.version == v, (header.version, v)
        for b in bucket_bodies(header):
            req = parse(b, UpdateWeightsFromDistributedReqInput)
            for name, t in runner.receive_weights_from_distributed(
                    names=req.names, dtypes=req.dtypes, shapes=req.shapes, group_name=req.group_name,
                    load_format=req.load_format):
                got[f"{v}/{name}"] = t.clone()
    ok, msg = runner.destroy_weights_update_group(body["group_name"])
    assert ok, msg
save_file(got, args["out"])
with open(args["out"] + ".json", "w") as f:
    json.dump(joins, f)
"""


def _weights(version: int) -> dict[str, torch.Tensor]:
    """Arbitrary bit patterns (NaNs included: bit-exactness, not value equality), new per version."""
    return random_weights(SPECS, 2000 + version)


@pytest.mark.slow
def test_driftrl_publisher_reaches_sglangs_own_receiver_and_rebuilds(tmp_path):
    from safetensors.torch import load_file

    run_dir, out = str(tmp_path / "run"), str(tmp_path / "got.safetensors")
    args = {"run_dir": run_dir, "out": out, "phases": PHASES}
    child = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(args)], cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        # SGLang's imports take ~15 s on a loaded 2-core machine: the join timeout covers them
        pub = NcclPublisher(run_dir, _weights(0), bucket_bytes=512, world_size=2, backend="torch_dist",
                            torch_backend="gloo", join_timeout_s=120, collective_timeout_s=60)
        assert len(pub.header.buckets) > 3
        for v in PHASES[0]:
            pub.publish(v, _weights(v))
        deadline = time.monotonic() + 60
        while not os.path.exists(out + ".rejoin") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub._sock.poll(30_000)  # the repeat Hello is queued (not consumed) before the next version
        for v in PHASES[1]:
            pub.publish(v, _weights(v))
        assert child.wait(60) == 0
        assert pub.rebuilds == 1
        pub.close()
    finally:
        child.kill()
    got = load_file(out)
    versions = [v for phase in PHASES for v in phase]
    assert set(got) == {f"{v}/{name}" for v in versions for name, _, _ in SPECS}
    for v in versions:
        for name, t in _weights(v).items():
            g = got[f"{v}/{name}"]
            assert g.dtype == t.dtype and torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    with open(out + ".json") as f:
        first, second = json.load(f)
    assert (first["rank_offset"], first["world_size"]) == (second["rank_offset"], second["world_size"]) == (1, 2)
    assert first["master_port"] != second["master_port"]
