"""Context parallelism (model/context_parallel.py) is exact: two real processes in a Gloo group on
127.0.0.1, each holding half of every sequence, give the one-process learner's log-probs, entropies
and gradients within 1e-5 (FP32 body) on a padded batch of ragged rows, for the Llama, Qwen2 (qkv
bias) and Qwen3 (q/k norm) shapes and a 9-query/3-KV-head model, and their optimiser steps agree.

The two ranks are this file run as a script (``python -m tests.unit.test_context_parallel RANK PORT
DIR``), once for all cases; each writes its measurements as JSON, which the tests read.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from core import config as C
from model.context_parallel import head_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = {  # name: ArchConfig fields (num_attention_heads, num_key_value_heads, family switches)
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3_mqa": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=1),
    "heads9_kv3": dict(model_type="llama", num_attention_heads=9, num_key_value_heads=3),
    # the two ranks recompute each layer in backward (learner.checkpoint_layers), its all-to-alls included
    "qwen2_checkpointed": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, checkpoint=True),
}
LENGTHS, PROMPT = [4, 4, 9, 13, 18, 7, 16, 11], 3  # rows of 4 (3 prompt tokens) alone in a micro-batch


def _model(fields: dict):
    from model.arch import ArchConfig
    from model.decoder import Decoder

    torch.manual_seed(0)
    model = Decoder(ArchConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               head_dim=8, max_position_embeddings=64, **fields))
    with torch.no_grad():  # norms away from 1, so q/k norm and the final norm matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _batch(vocab: int):
    from learner.batching import Batch

    g = torch.Generator().manual_seed(1)
    n, width = len(LENGTHS), max(LENGTHS)
    key_mask = torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None]
    ids = torch.randint(1, vocab, (n, width), generator=g) * key_mask
    mask = (key_mask[:, 1:] & (torch.arange(1, width) >= PROMPT)[None]).float()
    return Batch(ids=ids, key_mask=key_mask, mask=mask, behaviour_logp=torch.zeros(n, width - 1),
                 rewards=torch.rand(2, n // 2, generator=g), staleness=torch.zeros(n, dtype=torch.long),
                 keys=[], num_tokens=int(mask.sum()))


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


def _case(fields: dict) -> dict:
    from learner.backends.torch import TorchBackend

    fields = dict(fields)
    again = "true" if fields.pop("checkpoint", False) else "false"
    model, cfgs = _model(fields), [C.load(None, ["learner.body_dtype=float32", "learner.device=cpu",
                                                  "learner.micro_batch_tokens=8", f"learner.context_parallel={n}",
                                                  f"learner.checkpoint_layers={again if n == 2 else 'false'}"])
                                   for n in (1, 2)]
    one, two = (TorchBackend(cfg, "", model=copy.deepcopy(model)) for cfg in cfgs)
    batch = _batch(model.cfg.vocab_size)
    with torch.no_grad():
        lp1, ent1 = one.logprobs(batch, with_entropy=True)
        lp2, ent2 = two.logprobs(batch, with_entropy=True)
    noise = 0.1 * torch.randn(lp1.shape, generator=torch.Generator().manual_seed(2))
    batch = dataclasses.replace(batch, behaviour_logp=(lp1 + noise) * batch.mask)  # ratios away from 1
    m1, m2 = one.forward_backward(batch), two.forward_backward(batch)
    grads = [{k: p.grad for k, p in b.model.named_parameters()} for b in (one, two)]
    out = dict(logp=_max_diff(lp1, lp2), entropy=_max_diff(ent1, ent2), logp_scale=float(lp1.abs().max()),
               loss=abs(m1["learner/loss"] - m2["learner/loss"]),
               ent_metric=abs(m1["learner/entropy"] - m2["learner/entropy"]),
               grad=max(_max_diff(grads[0][k], grads[1][k]) for k in grads[0]),
               grad_scale=min(float(g.abs().max()) for g in grads[0].values()))
    two.optim_step()
    out["params_rank_spread"] = _rank_spread(torch.cat([p.detach().reshape(-1) for p in two.model.parameters()]))
    out["wrong_positions"] = _wrong_positions(two, batch)
    return out


def _rank_spread(x) -> float:
    """Largest difference of ``x`` between the two ranks (0: every rank holds the same)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(parts, x)
    return _max_diff(parts[0], parts[1])


def _wrong_positions(backend, batch) -> float:
    """How far the hidden states move when every rank numbers its chunk from 0 (a wrong split)."""
    cp, ids, key_mask = backend.cp, batch.ids[:, :-1], batch.key_mask[:, :-1]
    pos = torch.arange(key_mask.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        right = backend.model(cp.shard(ids), cp.shard(pos), cp.pad(key_mask), cp=cp)
        wrong = backend.model(cp.shard(ids), pos[:, : right.shape[1]], cp.pad(key_mask), cp=cp)
    return _max_diff(right, wrong)  # rank 0's chunk starts at 0 either way: only rank 1's moves


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results = {name: _case(fields) for name, fields in CASES.items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()  # neither rank tears its sockets down while the other still reads from them
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.test_context_parallel", str(r), str(port), str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_one_rank_logprobs_and_gradients(ranks, case):
    for r in ranks:
        got = r[case]
        assert got["logp"] < 1e-5 and got["entropy"] < 1e-5 and got["logp_scale"] > 1.0
        assert got["loss"] < 1e-5 and got["ent_metric"] < 1e-5
        assert got["grad"] < 1e-5 and got["grad_scale"] > 1e-4  # every parameter has a real gradient
        assert got["params_rank_spread"] == 0.0  # gradients summed over the group: one optimiser step
    assert ranks[1][case]["wrong_positions"] > 1e-2  # the check can fail: chunk positions matter


def test_head_plan_sends_each_query_slot_the_kv_head_it_reads():
    for nh, nkv, size in [(4, 2, 2), (9, 3, 2), (8, 1, 2), (9, 3, 4), (6, 2, 4), (1, 1, 2), (12, 4, 3), (5, 5, 2)]:
        rep, m = nh // nkv, -(-nh // size)
        for rank in range(size):
            q_index, kv_index, local = head_plan(nh, nkv, size, rank)
            k = len(kv_index) // size
            assert q_index[:nh] == list(range(nh)) and len(q_index) == size * m
            slots = local if local is not None else [i // (m // k) for i in range(m)]
            assert [kv_index[rank * k + j] for j in slots] == [q_index[rank * m + i] // rep for i in range(m)]
    assert len(head_plan(9, 3, 2, 0)[1]) == 4  # 2 KV heads per rank, not 5: only the ones read
    assert head_plan(4, 2, 2, 0)[2] is None  # whole KV groups: nothing replicated


@pytest.mark.parametrize("overrides, why", [
    (["learner.context_parallel=0"], ">= 1"),
    (["learner.context_parallel=2", "learner.backend=megatron"], "TEDotProductAttention"),
    (["learner.context_parallel=9000"], "longest sequence"),
])
def test_a_context_parallel_degree_that_cannot_work_is_refused(overrides, why):
    with pytest.raises(C.ConfigError, match="context_parallel") as e:
        C.load(None, overrides)
    assert why in str(e.value)


def test_without_a_group_a_context_parallel_backend_says_what_is_missing(monkeypatch):
    from model.context_parallel import group_of

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    # another test in this process may have made a group of one (the Megatron CPU shim does)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="one learner process per CP rank.*MASTER_ADDR"):
        group_of(2, torch.device("cpu"))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
