"""weightsync: layout, shared memory (zero-copy and copying readers, pins, dead readers, a
multi-process torn-read hunt, an engine driven through it), filesystem, and the NCCL transport's
protocol over Gloo on CPU."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from core.config import load
from core.messages import WeightUpdateHeader, decoder, encode
from weightsync import layout, shm
from weightsync.base import make_publisher, make_subscriber
from weightsync.filesystem import FsPublisher, FsSubscriber, versions_on_disk
from weightsync.layout import ALIGN, LayoutError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8,
          torch.bool, torch.float64]


def _random_bits(dtype, shape, gen):
    """Arbitrary bit patterns (NaNs, denormals included): bit-exactness, not value equality."""
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(autouse=True)
def _no_region_left(tmp_path):
    """A failing test must not leave its region in /dev/shm."""
    yield
    for run_dir in (tmp_path, tmp_path / "run"):
        with contextlib.suppress(OSError):
            path = shm.region_path(str(run_dir))
            for p in (path, f"{path}.tmp") if path else ():
                if os.path.exists(p):
                    os.unlink(p)


def _cfg(transport):
    return load(None, [f'weightsync.transport="{transport}"'])


# ---- layout ---------------------------------------------------------------------------------

SPECS = [("embed", "bfloat16", [50, 32]), ("l0.q", "float32", [32, 32]), ("l0.norm", "float32", [32]),
         ("pos", "int64", [7]), ("l1.q", "bfloat16", [32, 32]), ("scale", "float32", []),
         ("empty", "float16", [0, 4]), ("big", "float32", [40, 40]), ("mask", "bool", [3, 3])]


def test_header_roundtrips_through_msgspec():
    h = layout.plan(12, SPECS, bucket_bytes=4096)
    back = decoder(WeightUpdateHeader).decode(encode(h))
    assert back == h
    assert back.version == 12 and back.names == [s[0] for s in SPECS]
    assert layout.layout_hash(back) == layout.layout_hash(layout.with_version(h, 99))
    assert layout.layout_hash(back) != layout.layout_hash(layout.plan(12, SPECS[:-1], 4096))


def test_buckets_respect_size_dtype_and_alignment():
    bucket_bytes = 4096
    h = layout.plan(0, SPECS, bucket_bytes)
    dtype_of = dict(zip(h.names, h.dtypes))
    shape_of = dict(zip(h.names, h.shapes))
    seen = []
    for b in h.buckets:
        assert {dtype_of[n] for n in b.names} == {b.dtype}
        assert b.nbytes % ALIGN == 0
        ends = []
        for n, off in zip(b.names, b.offsets):
            assert off % ALIGN == 0
            assert not ends or off >= ends[-1], "tensors overlap"
            ends.append(off + layout.tensor_nbytes(b.dtype, shape_of[n]))
        assert ends[-1] <= b.nbytes
        if len(b.names) > 1:
            assert b.nbytes <= bucket_bytes
        seen += b.names
    assert sorted(seen) == sorted(h.names)
    # "big" (6400 B) exceeds the bucket size: it is alone, never split
    big = [b for b in h.buckets if "big" in b.names]
    assert big[0].names == ["big"] and big[0].nbytes >= 6400
    # dtypes are grouped: one run of buckets per dtype
    order = [b.dtype for b in h.buckets]
    assert len({d for d in order}) == len([d for i, d in enumerate(order) if i == 0 or order[i - 1] != d])
    # several float32 tensors would not fit one 4 KiB bucket with "big": more than one bucket
    assert sum(b.dtype == "float32" for b in h.buckets) >= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_roundtrip_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    named = {f"t{i}": _random_bits(dtype, shape, gen) for i, shape in enumerate([(33, 7), (5,), (), (0, 3), (300,)])}
    named["other"] = _random_bits(torch.float32, (9,), gen)  # a second dtype in the same update
    h = layout.header_for(3, named, bucket_bytes=512)
    flat = torch.zeros(layout.total_nbytes(h), dtype=torch.uint8)
    for name, view in layout.views(h, flat).items():
        view.copy_(named[name])
    wire = flat.clone()  # what a reader sees: a different buffer with the same bytes
    back = layout.views(h, wire)
    assert set(back) == set(named)
    for name, t in named.items():
        assert _same_bits(back[name], t), name
    # per-bucket buffers (the NCCL path) hold the same bytes
    for i, (start, b) in enumerate(zip(layout.bucket_starts(h), h.buckets)):
        part = layout.views(h, wire[start:start + b.nbytes].clone(), bucket=i)
        assert set(part) == set(b.names)
        for name in b.names:
            assert _same_bits(part[name], named[name])


def test_layout_rejects_bad_input():
    with pytest.raises(LayoutError, match="duplicate"):
        layout.plan(0, [("a", "float32", [1]), ("a", "float32", [2])], 1024)
    with pytest.raises(LayoutError, match="unsupported dtype"):
        layout.header_for(0, {"c": torch.zeros(2, dtype=torch.complex64)}, 1024)
    with pytest.raises(LayoutError, match="no tensors"):
        layout.plan(0, [], 1024)
    h = layout.plan(0, [("a", "float32", [4])], 1024)
    with pytest.raises(LayoutError, match="shape"):
        layout.check_targets(h, {"a": torch.zeros(1)}, role="t")  # would broadcast silently
    with pytest.raises(LayoutError, match="missing"):
        layout.check_targets(h, {"b": torch.zeros(4)}, role="t")


# ---- shared memory, one process ----------------------------------------------------------------


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 33, generator=g), "emb": torch.randn(40, 16, generator=g).bfloat16(),
            "steps": torch.arange(5), "ln": torch.randn(16, generator=g).half()}


def test_shm_publish_apply_in_one_process(tmp_path):
    run_dir = str(tmp_path)
    params = _model()
    pub = make_publisher(_cfg("shm"), run_dir, params)
    sub = make_subscriber(_cfg("shm"), run_dir, timeout_s=5)
    target = {k: torch.zeros_like(v) for k, v in params.items()}
    assert sub.latest_version() == -1 and sub.apply(target) is None

    stats = pub.publish(0, params)
    assert stats.version == 0 and stats.bytes == sum(t.nbytes for t in params.values())
    assert sub.latest_version() == 0
    assert sub.apply(target) == 0
    assert all(_same_bits(target[k], params[k]) for k in params)
    assert sub.stats.mapped == len(params)  # same dtype on CPU: mapped, not copied
    assert sub.apply(target) is None  # nothing newer

    # dtype-converting apply: an actor holding float32 copies of bf16/fp16 weights
    wide = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in params.items()}
    sub2 = make_subscriber(_cfg("shm"), run_dir, timeout_s=5)
    assert sub2.apply(wide) == 0
    assert torch.equal(wide["emb"], params["emb"].float())
    assert sub2.stats.mapped == 1  # only "w" is float32 already; the rest was converted

    later = _model(seed=1)
    for v in (1, 2, 3):
        pub.publish(v, later if v == 3 else params)
    assert sub.apply(target) == 3
    assert all(_same_bits(target[k], later[k]) for k in params)
    assert sub.stats.versions_skipped == 2
    m = sub.metrics()
    assert m["weightsync/versions_skipped"] == 2 and m["weightsync/bytes"] == stats.bytes
    assert m["weightsync/apply_s"] > 0 and pub.metrics()["weightsync/publish_s"] > 0

    with pytest.raises(ValueError, match="increase"):
        pub.publish(3, params)
    changed = dict(params, w=torch.zeros(64, 34))
    with pytest.raises(LayoutError, match="'w'"):
        pub.publish(4, changed)
    with pytest.raises(LayoutError, match="dtype"):
        pub.publish(4, dict(params, w=params["w"].double()))
    with pytest.raises(LayoutError, match="missing"):
        sub.apply({k: v for k, v in target.items() if k != "ln"})

    path = pub.path
    pub.close()
    pub.close()  # idempotent
    assert not os.path.exists(path)
    assert sub.publisher_closed and sub.latest_version() == 3
    assert _same_bits(target["w"], later["w"])  # mapped weights outlive the unlinked region
    for s in (sub, sub2):
        s.close()
        s.close()
    # a closed subscriber no longer pins, but the memory stays mapped while tensors use it
    assert _same_bits(target["w"], later["w"])


def test_shm_pinned_slots_are_never_overwritten(tmp_path, monkeypatch):
    """Two slots, one reader: while it holds a slot (mapped, or mid-copy) the writer must skip
    rather than write into it; a mapped reader's weights stay put until it applies again."""
    v0, v1, v2 = _model(0), _model(1), _model(2)
    pub = shm.ShmPublisher(str(tmp_path), v0, max_readers=1, slots=2, wait_s=0.01)
    mapper = shm.ShmSubscriber(str(tmp_path), timeout_s=5)
    with pytest.raises(RuntimeError, match="reader entries"):
        shm.ShmSubscriber(str(tmp_path), timeout_s=5)  # the table holds max_readers
    pub.publish(0, v0)
    held = {k: torch.zeros_like(v) for k, v in v0.items()}
    assert mapper.apply(held) == 0 and pub.readers() == [(os.getpid(), 0)]
    assert pub.publish(1, v1).version == 1  # slot 1
    assert pub.publish(2, v2) is None  # slot 0 pinned, slot 1 current: skipped, not overwritten
    assert pub.skipped == 1 and pub.metrics()["weightsync/publishes_skipped"] == 1
    assert all(_same_bits(held[k], v0[k]) for k in v0)
    assert mapper.apply(held) == 1 and all(_same_bits(held[k], v1[k]) for k in v0)
    assert pub.readers() == [(os.getpid(), 1)]  # the pin moved with the mapping
    assert pub.publish(3, v2).version == 3  # slot 0 is free again
    mapper.close()
    assert pub.readers() == []

    # a copying reader pins its slot for the length of the copy: two publishes land mid-copy
    copier = shm.ShmSubscriber(str(tmp_path), timeout_s=5, zero_copy=False)
    real_copy, armed = shm._copy_all, [True]

    def copy_while_publishing(dst, src):
        if armed and armed.pop():
            assert pub.publish(4, v0).version == 4  # into the free slot
            assert pub.publish(5, v1) is None  # the other one is being copied from
        real_copy(dst, src)

    monkeypatch.setattr(shm, "_copy_all", copy_while_publishing)
    got = {k: torch.zeros_like(v) for k, v in v0.items()}
    assert copier.apply(got) == 3 and copier.stats.mapped == 0
    assert all(_same_bits(got[k], v2[k]) for k in v0)
    assert pub.readers() == [(os.getpid(), -1)]  # released after the copy
    assert copier.apply(got) == 4 and all(_same_bits(got[k], v0[k]) for k in v0)
    copier.close()
    pub.close()


def _pinning_reader(run_dir: str, ready: str, linger_s: float) -> None:
    """Maps the newest weights, says so, then lingers (to be killed) or exits without close()."""
    torch.set_num_threads(1)
    sub = shm.ShmSubscriber(run_dir, timeout_s=30)
    target = {k: torch.zeros_like(v) for k, v in _model().items()}
    assert sub.apply(target) is not None and sub.stats.mapped == len(target)
    open(ready, "w").close()
    time.sleep(linger_s)


def test_shm_dead_readers_release_their_pins(tmp_path, procs):
    run_dir = str(tmp_path / "run")
    pub = shm.ShmPublisher(run_dir, _model(), max_readers=1, slots=2, wait_s=0.05)
    pub.publish(0, _model())
    ctx = mp.get_context("spawn")

    def start(name, linger_s):
        ready = str(tmp_path / name)
        p = ctx.Process(target=_pinning_reader, args=(run_dir, ready, linger_s), daemon=True)
        p.start()
        procs.append(p)
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            assert time.monotonic() < deadline and p.is_alive(), "reader did not start"
            time.sleep(0.05)
        return p

    # a reader that exits without close() frees its entry at interpreter exit
    quitter = start("quitter", 0)
    quitter.join(30)
    assert quitter.exitcode == 0 and pub.readers() == []

    victim = start("victim", 60)
    assert pub.readers() == [(victim.pid, 0)]
    assert pub.publish(1, _model(1)).version == 1
    assert pub.publish(2, _model(2)) is None  # slot 0 pinned by the live reader
    victim.kill()  # SIGKILL: no finalizer runs
    os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)  # dead but not reaped: a zombie
    assert pub.publish(3, _model(3)).version == 3  # the dead reader's pin was reclaimed
    assert pub.readers() == [] and pub.skipped == 1
    late = shm.ShmSubscriber(run_dir, timeout_s=5)  # and so was its table entry
    target = {k: torch.zeros_like(v) for k, v in _model().items()}
    assert late.apply(target) == 3 and _same_bits(target["w"], _model(3)["w"])
    late.close()
    pub.close()


def test_shm_subscriber_waits_for_publisher(tmp_path):
    with pytest.raises(TimeoutError, match=str(tmp_path)):
        shm.ShmSubscriber(str(tmp_path), timeout_s=0.2)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("sub", shm.ShmSubscriber(str(tmp_path), timeout_s=20)))
    t.start()
    time.sleep(0.2)
    assert "sub" not in got  # still waiting
    pub = shm.ShmPublisher(str(tmp_path), _model())
    t.join(20)
    pub.publish(5, _model())
    assert got["sub"].latest_version() == 5
    got["sub"].close()
    pub.close()


def test_shm_second_live_publisher_refused_and_restart_reattaches(tmp_path):
    params = _model()
    pub = shm.ShmPublisher(str(tmp_path), params)
    with pytest.raises(RuntimeError, match="already live"):
        shm.ShmPublisher(str(tmp_path), params)
    sub = shm.ShmSubscriber(str(tmp_path), timeout_s=5)
    pub.publish(0, params)
    pub.close()
    # a restarted learner: the reader moves to the new region
    pub2 = shm.ShmPublisher(str(tmp_path), params)
    pub2.publish(10, _model(seed=3))
    sub._next_reattach = 0.0
    assert sub.latest_version() == 10
    target = {k: torch.zeros_like(v) for k, v in params.items()}
    assert sub.apply(target) == 10 and _same_bits(target["w"], _model(seed=3)["w"])
    pub2.close()
    # a restart with another model: the reader's tensors no longer fit, and it says so
    pub3 = shm.ShmPublisher(str(tmp_path), dict(params, w=torch.zeros(64, 34)))
    pub3.publish(11, dict(params, w=torch.ones(64, 34)))
    sub._next_reattach = 0.0
    assert sub.latest_version() == 11
    with pytest.raises(LayoutError, match="'w' has shape"):
        sub.apply(target)
    pub3.close()
    sub.close()


def test_shm_publisher_dropped_without_close_retires_region(tmp_path):
    pub = shm.ShmPublisher(str(tmp_path), _model())
    sub = shm.ShmSubscriber(str(tmp_path), timeout_s=5)
    path = pub.path
    del pub  # e.g. a learner that exits without close()
    assert not os.path.exists(path)
    assert sub.publisher_closed
    sub.close()


def test_shm_reader_liveness_rules():
    import subprocess

    me, start, ns = shm._me()
    assert shm._alive(me, start, ns) and shm._alive(me, 0, ns)  # 0: start time unknown
    assert not shm._alive(me, start + 1, ns)  # same pid, another process: the pid was reused
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not shm._alive(gone.pid, 0, ns)
    assert shm._alive(gone.pid, 0, ns + 1)  # another pid namespace: never presumed dead


def _qwen3(seed: int):
    from model.decoder import ArchConfig, Qwen3

    torch.manual_seed(seed)
    return Qwen3(ArchConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shm_drives_a_real_engine(tmp_path, dtype):
    """The actor's path: engine.params() into apply() called between decode steps, inside the
    engine's inference_mode. fp32 actors map the published weights, bf16 actors copy them; either
    way generation must equal an engine built from the same weights."""
    from actor.engines.torch import TorchEngine
    from model.sampling import SamplingSpec

    def engine(model, weights=None):
        return TorchEngine(model, SamplingSpec(), eos_ids=[47], pad_id=0, dtype=dtype, max_new_tokens=5,
                           weights=weights)

    learner = _qwen3(seed=1)
    weights = {k: v.detach() for k, v in learner.state_dict().items()}
    pub = shm.ShmPublisher(str(tmp_path), weights, max_readers=1)
    with torch.inference_mode():  # as if (re)attached mid-generation: its views must stay normal
        sub = shm.ShmSubscriber(str(tmp_path), timeout_s=5)
    actor = engine(_qwen3(seed=2), sub)  # other initial weights: the update must reach the module
    params = actor.params()
    assert all(p is q for p, q in zip(params.values(), actor.model.parameters()))
    prompts = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1]]

    stale = actor.generate(prompts, greedy=True)
    assert {v for s in stale for v in s.versions} == {-1}  # nothing published yet
    for version, seed in [(0, 1), (1, 3)]:
        if seed != 1:
            weights = {k: v.detach() for k, v in _qwen3(seed).state_dict().items()}
        pub.publish(version, weights)
        got = actor.generate(prompts, greedy=True)
        ref_model = _qwen3(seed=0)
        ref_model.load_state_dict(weights)
        want = engine(ref_model).generate(prompts, greedy=True)
        assert [s.versions for s in got] == [[version] * len(s.tokens) for s in got]
        assert [(s.tokens, s.logprobs) for s in got] == [(s.tokens, s.logprobs) for s in want]
        assert sub.stats.mapped == (len(params) if dtype == "float32" else 0)
        assert not any(p.is_inference() for p in actor.model.parameters())
    assert [s.logprobs for s in stale] != [s.logprobs for s in got]  # the weights really changed
    sub.close()
    pub.close()


# ---- shared memory, several processes ----------------------------------------------------------

N_VERSIONS = 1500
_PATTERN = (torch.arange(512 * 512, dtype=torch.float32) % 251).reshape(512, 512) * 1024


def _versioned(version: int, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor identifies its version; the pattern makes partial overwrites visible too.
    With ``out``, fills those tensors in place (the publisher's fast path)."""
    out = out if out is not None else {
        "w": torch.empty(512, 512), "w2": torch.empty(64, 64), "b": torch.empty(512),
        "emb": torch.empty(3000, dtype=torch.bfloat16), "ids": torch.empty(64, dtype=torch.int64),
        "ln": torch.empty(17, 3, dtype=torch.float16)}
    torch.add(_PATTERN, version, out=out["w"])
    torch.sub(_PATTERN[:64, :64], version, out=out["w2"])
    out["b"].fill_(-version)
    out["emb"].fill_(version % 128)
    torch.add(torch.arange(64), version * 1_000_003, out=out["ids"])
    out["ln"].fill_(version % 1024)
    return out


def _holds(target, version: int) -> bool:
    want = _versioned(version)
    return all(torch.equal(target[k], want[k].to(target[k].dtype)) for k in want)


def _reader_proc(kind: str, run_dir: str, out_path: str, n_versions: int, wide: bool) -> None:
    torch.set_num_threads(1)
    if kind == "shm":
        sub = shm.ShmSubscriber(run_dir, timeout_s=30)
    else:
        from weightsync.nccl import NcclSubscriber

        sub = NcclSubscriber(run_dir, timeout_s=30, collective_timeout_s=60)
    # a "wide" reader holds float64, column-major copies: shm copies into it (a converting,
    # strided copy several times slower than the publisher's, so many publishes land mid-copy);
    # the other reader's tensors match the published dtypes, so shm maps them
    if wide:
        target = {k: torch.zeros(v.shape[::-1], dtype=torch.float64).permute(*range(v.dim() - 1, -1, -1))
                  for k, v in _versioned(0).items()}
    else:
        target = {k: torch.zeros_like(v) for k, v in _versioned(0).items()}
    open(out_path + ".ready", "w").close()
    applied, bad, changed, held = [], [], [], []
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        if sub.latest_version() <= sub.stats.last_version:
            time.sleep(0.0005 if kind == "nccl" else 0)
            continue
        v = sub.apply(target)
        if v is None:
            continue
        applied.append(v)
        if not _holds(target, v):
            bad.append(v)
        if sub.stats.mapped and len(applied) % 3 == 1 and v < n_versions - 1:
            # keep computing with version v while the publisher moves on: the slot it is
            # mapped from is pinned, so it must not change (a writer blind to pins reuses it
            # within two publishes)
            until = min(v + 4, n_versions - 1)
            while sub.latest_version() < until and time.monotonic() < deadline:
                time.sleep(0)
            held.append(sub.latest_version() - v)
            if not _holds(target, v):
                changed.append(v)
        if v == n_versions - 1:
            break
    with open(out_path, "w") as f:
        json.dump({"applied": applied, "bad": bad, "changed": changed, "held": held, "mapped": sub.stats.mapped,
                   "versions_skipped": sub.stats.versions_skipped}, f)
    sub.close()


@pytest.fixture
def procs():
    started: list[mp.Process] = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()  # by pid, only the processes this test started
        p.join(10)


def _start_readers(procs, kind, run_dir, tmp_path, n=2):
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"reader{i}.json") for i in range(n)]
    for i, out in enumerate(outs):
        p = ctx.Process(target=_reader_proc, args=(kind, run_dir, out, N_VERSIONS, i == 1), daemon=True)
        p.start()
        procs.append(p)
    return outs


def _check_readers(procs, outs):
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = [json.load(open(o)) for o in outs]
    for r in results:
        assert r["bad"] == [], f"applied states matching no single published version: {r['bad'][:5]}"
        assert r["applied"][-1] == N_VERSIONS - 1
        assert all(a < b for a, b in zip(r["applied"], r["applied"][1:])), "versions must increase"
        gaps = sum(b - a - 1 for a, b in zip(r["applied"], r["applied"][1:]))
        assert r["versions_skipped"] == gaps
    return results


def test_shm_concurrent_readers_never_see_torn_versions(tmp_path, procs):
    run_dir = str(tmp_path / "run")
    torch.set_num_threads(1)
    pub = shm.ShmPublisher(run_dir, _versioned(0), max_readers=2)
    outs = _start_readers(procs, "shm", run_dir, tmp_path)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(o + ".ready") for o in outs):
        assert time.monotonic() < deadline and all(p.is_alive() for p in procs)
        time.sleep(0.05)
    state = _versioned(0)
    for v in range(N_VERSIONS):
        pub.publish(v, _versioned(v, out=state))
    results = _check_readers(procs, outs)
    skipped = pub.skipped
    pub.close()
    assert skipped == 0  # 2 + max_readers slots: a publish never has to skip
    mapper, copier = results
    assert mapper["mapped"] == len(state) and copier["mapped"] == 0  # both modes ran
    assert mapper["changed"] == [], f"mapped weights changed while pinned: {mapper['changed'][:5]}"
    assert mapper["held"] and max(mapper["held"]) >= 2, "the publisher never moved on during a hold"
    assert all(len(r["applied"]) >= 2 for r in results)
    print("applies per reader:", [len(r["applied"]) for r in results], "publishes during holds:", mapper["held"])


# ---- filesystem ---------------------------------------------------------------------------------


def test_filesystem_roundtrip_keeps_newest_two(tmp_path):
    run_dir = str(tmp_path)
    params = _model()
    params["tied"] = params["w"]  # shared storage, as tied embeddings are
    pub = make_publisher(_cfg("filesystem"), run_dir, params)
    made = make_subscriber(_cfg("filesystem"), run_dir, timeout_s=5)
    assert isinstance(made, FsSubscriber)
    made.close()
    sub = FsSubscriber(run_dir, timeout_s=5, poll_s=0)  # no re-read interval: deterministic test
    target = {k: torch.zeros_like(v) for k, v in params.items()}
    assert sub.latest_version() == -1 and sub.apply(target) is None
    for v in range(4):
        pub.publish(v, params if v < 3 else _model(seed=v) | {"tied": _model(seed=v)["w"]})
    assert versions_on_disk(run_dir) == [2, 3]
    with open(os.path.join(run_dir, "weights", "LATEST")) as f:
        assert f.read().strip() == "3"
    assert sub.latest_version() == 3
    assert sub.apply(target) == 3
    assert all(_same_bits(target[k], _model(seed=3)[k]) for k in _model())
    assert sub.apply(target) is None
    pub.publish(4, params)
    assert sub.latest_version() == 4 and sub.apply(target) == 4
    assert _same_bits(target["emb"], params["emb"])
    assert not any(".tmp" in n for n in os.listdir(os.path.join(run_dir, "weights")))
    pub.close()
    pub.close()
    sub.close()


def test_filesystem_late_joiner(tmp_path):
    run_dir = str(tmp_path)
    with pytest.raises(TimeoutError, match="LAYOUT"):
        FsSubscriber(run_dir, timeout_s=0.2)
    pub = FsPublisher(run_dir, _versioned(0))
    for v in range(5):
        pub.publish(v, _versioned(v))
    pub.close()  # files outlive the learner: that is the point of this transport
    late = FsSubscriber(run_dir, timeout_s=1)
    target = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in _versioned(0).items()}
    assert late.latest_version() == 4
    assert late.apply(target) == 4
    assert torch.equal(target["w"], _versioned(4)["w"])
    assert torch.equal(target["emb"], _versioned(4)["emb"].float())
    assert late.stats.versions_skipped == 0  # not behind: it joined late
    late.close()


# ---- NCCL transport protocol, run over Gloo on CPU ------------------------------------------------


def test_collective_transport_protocol_over_gloo(tmp_path, procs):
    from weightsync.nccl import NcclPublisher

    run_dir = str(tmp_path / "run")
    torch.set_num_threads(1)
    outs = _start_readers(procs, "nccl", run_dir, tmp_path)
    pub = NcclPublisher(run_dir, _versioned(0), bucket_bytes=256 << 10, world_size=3, backend="gloo",
                        join_timeout_s=60, collective_timeout_s=60)
    assert len(pub.header.buckets) > 4  # several buckets per dtype-group are broadcast
    # every publish waits for both readers to join its broadcasts: a few versions, with gaps
    for v in [0, 1, 2, 50, 100, 200, N_VERSIONS - 1]:
        pub.publish(v, _versioned(v))
    results = _check_readers(procs, outs)
    pub.close()
    pub.close()
    for r in results:
        assert r["applied"][0] == 0 and r["applied"][-1] == N_VERSIONS - 1


def test_collective_transport_times_out_with_clear_errors(tmp_path):
    from weightsync.nccl import NcclPublisher, NcclSubscriber, endpoint_path

    run_dir = str(tmp_path)
    with pytest.raises(TimeoutError, match="endpoint"):
        NcclSubscriber(run_dir, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="0 of 2 subscribers joined"):
        NcclPublisher(run_dir, _model(), world_size=3, backend="gloo", join_timeout_s=0.3)
    assert not os.path.exists(endpoint_path(run_dir))  # a failed publisher leaves nothing behind
    with pytest.raises(ValueError, match="CUDA"):
        NcclPublisher(run_dir, _model(), world_size=1, backend="nccl")
