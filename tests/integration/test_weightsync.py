"""weightsync: layout; weights as versioned files (weightsync/files.py: the shm and filesystem
transports -- bit-exact for every dtype, mapped and copying readers, files reused only when no
reader has them open, unlink-while-mapped, damaged files refused, a multi-process torn-read hunt,
an engine driven through it); and the NCCL transport's protocol over Gloo on CPU."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time

import pytest
import torch

from core.config import load
from core.messages import WeightUpdateHeader, decoder, encode
from weightsync import files, layout
from weightsync.base import make_publisher, make_subscriber
from weightsync.files import DamagedFile, FsPublisher, FsSubscriber, ShmPublisher, ShmSubscriber
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
def _no_directory_left(tmp_path):
    """A failing test must not leave its directory in /dev/shm."""
    yield
    for run_dir in (tmp_path, tmp_path / "run"):
        files.remove_dead_region(str(run_dir))


def _cfg(transport):
    return load(None, [f'weightsync.transport="{transport}"'])


def _versions(directory) -> list[int]:
    return sorted(int(n[1:]) for n in os.listdir(directory) if files._VERSION.fullmatch(n))


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


# ---- versioned files, one process -----------------------------------------------------------------


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 33, generator=g), "emb": torch.randn(40, 16, generator=g).bfloat16(),
            "steps": torch.arange(5), "ln": torch.randn(16, generator=g).half()}


@pytest.mark.parametrize("transport", ["shm", "filesystem"])
def test_every_dtype_arrives_bit_exact_mapped_copied_and_converted(tmp_path, transport):
    gen = torch.Generator().manual_seed(1)
    shapes = [(33, 7), (5,), (), (0, 3), (300,)]
    state = {f"{d}.{i}".replace("torch.", ""): _random_bits(d, s, gen) for d in DTYPES for i, s in enumerate(shapes)}
    pub = make_publisher(_cfg(transport), str(tmp_path), state)
    pub.publish(0, state)
    same = {k: torch.zeros_like(v) for k, v in state.items()}
    strided = {k: torch.zeros(v.shape[::-1], dtype=v.dtype).permute(tuple(range(v.dim() - 1, -1, -1)))
               for k, v in state.items()}  # column-major: read through the staging buffer
    for zero_copy, targets in ((True, same), (False, strided)):
        sub = (ShmSubscriber if transport == "shm" else FsSubscriber)(str(tmp_path), 5, zero_copy=zero_copy)
        assert sub.apply(targets) == 0
        bad = [k for k in state if not _same_bits(targets[k].contiguous(), state[k])]
        assert bad == [], bad
        assert sub.stats.mapped == (len(state) if zero_copy else 0)  # CPU, published dtype: all mapped
        sub.close()
    wide = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}
    sub = make_subscriber(_cfg(transport), str(tmp_path), timeout_s=5)  # shm maps, filesystem copies
    doubles = len([v for v in state.values() if v.dtype == torch.float64])
    assert sub.apply(wide) == 0 and sub.stats.mapped == (doubles if transport == "shm" else 0)
    bad = [k for k, v in state.items() if not _same_bits(wide[k], v.double())]  # as copy_ converts
    assert bad == [], bad
    sub.close()
    pub.close()


def test_shm_publish_apply_in_one_process(tmp_path):
    run_dir = str(tmp_path)
    params = _model()
    pub = make_publisher(_cfg("shm"), run_dir, params)
    sub = make_subscriber(_cfg("shm"), run_dir, timeout_s=5)
    assert isinstance(pub, ShmPublisher) and isinstance(sub, ShmSubscriber)
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
    with pytest.raises(LayoutError, match="'w'"):
        pub.publish(4, dict(params, w=torch.zeros(64, 34)))
    with pytest.raises(LayoutError, match="dtype"):
        pub.publish(4, dict(params, w=params["w"].double()))
    with pytest.raises(LayoutError, match="missing"):
        sub.apply({k: v for k, v in target.items() if k != "ln"})

    directory = pub.dir
    pub.close()
    pub.close()  # idempotent
    assert not os.path.exists(directory) and not os.path.exists(os.path.join(run_dir, files.RECORD))
    assert not os.path.isdir(sub.dir) and sub.latest_version() == 3 and sub.apply(target) is None
    assert _same_bits(target["w"], later["w"])  # mapped weights outlive their unlinked file
    for s in (sub, sub2):
        s.close()
        s.close()
    assert _same_bits(target["w"], later["w"])


def _inode(pub, version: int) -> int:
    return os.stat(os.path.join(pub.dir, f"v{version}")).st_ino


def test_a_mapped_version_is_never_reused_and_a_released_one_is(tmp_path):
    """The publisher reuses a retired file only when no reader has it open: a mapped reader's
    weights stay put however far the publisher moves on, and files do not pile up."""
    pub = ShmPublisher(str(tmp_path), _model(0))
    mapper = ShmSubscriber(str(tmp_path), timeout_s=5)
    pub.publish(0, _model(0))
    held = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    assert mapper.apply(held) == 0 and mapper.stats.mapped == len(held)
    first = _inode(pub, 0)
    inodes = set()
    for v in range(1, 12):
        pub.publish(v, _model(v))
        inodes.add(_inode(pub, v))
    assert first not in inodes  # never rewritten while mapped...
    assert all(_same_bits(held[k], _model(0)[k]) for k in held)  # ...so the weights never changed
    assert len(inodes) <= pub.keep + 2, "retired files nobody has open must be reused, not piled up"
    assert mapper.apply(held) == 11 and all(_same_bits(held[k], _model(11)[k]) for k in held)
    for v in range(12, 16):  # the version 0 file is free now: it is reused
        pub.publish(v, _model(v))
        inodes.add(_inode(pub, v))
    assert first in inodes and pub.skipped == 0
    mapper.close()
    pub.close()


@pytest.mark.parametrize("transport", ["shm", "filesystem"])
def test_the_publisher_maps_none_of_its_versions(tmp_path, transport):
    """Versions are written, not mapped, by the learner: their pages are the transport's (/dev/shm, the page cache),
    never in the learner's resident memory; a reader still gets every bit (filesystem: its checksum verified)."""
    pub = make_publisher(_cfg(transport), str(tmp_path), _model(0))
    for v in range(4):
        pub.publish(v, _model(v))
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if pub.dir in line]
    assert mapped == [] and len(pub.visible) + len(pub.spares) >= 2
    held = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    sub = make_subscriber(_cfg(transport), str(tmp_path), timeout_s=5)
    assert sub.apply(held) == 3 and all(_same_bits(held[k], _model(3)[k]) for k in held)
    sub.close()
    pub.close()


def test_a_copying_reader_keeps_its_version_while_the_publisher_moves_on(tmp_path, monkeypatch):
    pub = ShmPublisher(str(tmp_path), _model(0))
    copier = ShmSubscriber(str(tmp_path), timeout_s=5, zero_copy=False)
    pub.publish(0, _model(0))
    opened = _inode(pub, 0)
    real_read, armed, during = files.Version._read, [True], []

    def read_while_publishing(self, *args):
        if armed and armed.pop():  # mid-copy: enough publishes to reuse every other file twice
            for v in range(1, 3 * (pub.keep + 2)):
                pub.publish(v, _model(v))
                during.append(_inode(pub, v))
        real_read(self, *args)

    monkeypatch.setattr(files.Version, "_read", read_while_publishing)
    got = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    assert copier.apply(got) == 0 and copier.stats.mapped == 0
    assert all(_same_bits(got[k], _model(0)[k]) for k in got)  # the version it opened, whole
    assert opened not in during
    newest = 3 * (pub.keep + 2) - 1
    assert copier.apply(got) == newest and all(_same_bits(got[k], _model(newest)[k]) for k in got)
    copier.close()
    pub.close()


def test_unlink_while_mapped_keeps_the_readers_weights(tmp_path):
    """A reader's mapped weights survive the publisher unlinking their file: on close, on a
    SIGKILLed publisher's cleanup (remove_dead_region), or by hand."""
    run_dir = str(tmp_path)
    pub = ShmPublisher(run_dir, _model(0))
    pub.publish(7, _model(7))
    a = ShmSubscriber(run_dir, 5)
    mapped = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    assert a.apply(mapped) == 7 and a.stats.mapped == len(mapped)
    os.unlink(os.path.join(pub.dir, "v7"))  # by hand
    assert all(_same_bits(mapped[k], _model(7)[k]) for k in mapped)
    pub.publish(8, _model(8))
    assert a.apply(mapped) == 8
    directory = pub.dir
    pub._finalizer.detach()  # as if SIGKILLed: nothing cleaned up, the lock dropped with the fd
    os.close(pub._lock_fd)
    assert os.path.isdir(directory)
    assert files.remove_dead_region(run_dir) >= 1
    assert not os.path.exists(directory) and not os.path.exists(os.path.join(run_dir, files.RECORD))
    assert all(_same_bits(mapped[k], _model(8)[k]) for k in mapped)
    torch.manual_seed(0)
    for _ in range(3):  # the pages stay valid for computation, not just for one read
        assert torch.equal(mapped["w"] @ torch.ones(33), _model(8)["w"] @ torch.ones(33))
    a.close()


def test_damaged_or_truncated_files_are_refused_by_name(tmp_path):
    run_dir = str(tmp_path)
    pub = FsPublisher(run_dir, _model(0))
    target = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    sub = FsSubscriber(run_dir, 5, poll_s=0)
    for v, damage in enumerate(["truncate", "payload", "header", "version", "magic"]):
        pub.publish(v, _model(v))
        path = os.path.join(pub.dir, f"v{v}")
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            if damage == "truncate":
                f.truncate(len(data) - 100)
            else:
                at = {"payload": len(data) - 10, "header": files._PREFIX.size + 3, "version": 8, "magic": 0}[damage]
                data[at] ^= 0x40
                f.seek(0)
                f.write(data)
        before = {k: t.clone() for k, t in target.items()}
        with pytest.raises(DamagedFile, match=f"v{v}"):
            sub.apply(target)
        assert all(torch.equal(target[k], before[k]) for k in target), f"{damage}: bytes applied anyway"
    # shm files carry no payload checksum, but a truncated one is refused all the same
    shm_pub = ShmPublisher(str(tmp_path / "run"), _model(0))
    shm_pub.publish(0, _model(0))
    os.truncate(os.path.join(shm_pub.dir, "v0"), files.PAGE)
    shm_sub = ShmSubscriber(str(tmp_path / "run"), 5)
    with pytest.raises(DamagedFile, match="truncated or damaged"):
        shm_sub.apply(target)
    # LATEST must name a version file (shm: a symlink, read and never followed; filesystem: a file)
    os.unlink(os.path.join(shm_pub.dir, files.LATEST))
    os.symlink("../../etc/passwd", os.path.join(shm_pub.dir, files.LATEST))
    with pytest.raises(DamagedFile, match="not a version file"):
        shm_sub.latest_version()
    with open(os.path.join(pub.dir, files.LATEST), "w") as f:
        f.write("../../etc/passwd\n")
    with pytest.raises(DamagedFile, match="not a version file"):
        sub.latest_version()
    shm_sub.close()
    shm_pub.close()
    pub.close()
    sub.close()


def test_nothing_is_pickled(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    for transport, sub_cls in (("shm", ShmSubscriber), ("filesystem", FsSubscriber)):
        run_dir = str(tmp_path / transport)
        pub = make_publisher(_cfg(transport), run_dir, _model(0))
        pub.publish(0, _model(1))
        target = {k: torch.zeros_like(v) for k, v in _model(0).items()}
        assert sub_cls(run_dir, 5).apply(target) == 0 and _same_bits(target["emb"], _model(1)["emb"])
        with open(os.path.join(pub.dir, "v0"), "rb") as f:
            head = f.read(files.PAGE)
        assert head.startswith(files.MAGIC) and b"ws_file" in head  # a msgspec header
        pub.close()


def test_shm_subscriber_waits_for_publisher(tmp_path):
    with pytest.raises(TimeoutError, match=str(tmp_path)):
        ShmSubscriber(str(tmp_path), timeout_s=0.2)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("sub", ShmSubscriber(str(tmp_path), timeout_s=20)))
    t.start()
    time.sleep(0.2)
    assert "sub" not in got  # still waiting
    pub = ShmPublisher(str(tmp_path), _model())
    t.join(20)
    pub.publish(5, _model())
    assert got["sub"].latest_version() == 5
    got["sub"].close()
    pub.close()


def test_shm_second_live_publisher_refused_and_restart_followed(tmp_path):
    params = _model()
    pub = ShmPublisher(str(tmp_path), params)
    with pytest.raises(RuntimeError, match="already live"):
        ShmPublisher(str(tmp_path), params)
    sub = ShmSubscriber(str(tmp_path), timeout_s=5)
    pub.publish(0, params)
    pub.close()
    # a restarted learner: a new directory, which the reader finds through run_dir
    pub2 = ShmPublisher(str(tmp_path), params)
    pub2.publish(10, _model(seed=3))
    sub._next_find = 0.0
    assert sub.latest_version() == 10 and sub.dir == pub2.dir
    target = {k: torch.zeros_like(v) for k, v in params.items()}
    assert sub.apply(target) == 10 and _same_bits(target["w"], _model(seed=3)["w"])
    pub2.close()
    # a restart with another model: the reader's tensors no longer fit, and it says so
    pub3 = ShmPublisher(str(tmp_path), dict(params, w=torch.zeros(64, 34)))
    pub3.publish(11, dict(params, w=torch.ones(64, 34)))
    sub._next_find = 0.0
    assert sub.latest_version() == 11
    with pytest.raises(LayoutError, match="'w' has shape"):
        sub.apply(target)
    pub3.close()
    sub.close()


def test_shm_publisher_dropped_without_close_leaves_nothing(tmp_path):
    pub = ShmPublisher(str(tmp_path), _model())
    pub.publish(0, _model())
    sub = ShmSubscriber(str(tmp_path), timeout_s=5)
    directory = pub.dir
    del pub  # e.g. a learner that exits without close()
    assert not os.path.exists(directory) and os.listdir(tmp_path) == []
    assert not os.path.isdir(sub.dir)  # the publisher is gone
    sub.close()


def _holding_reader(run_dir: str, ready: str) -> None:
    """Maps the newest weights, says so, then waits to be killed."""
    torch.set_num_threads(1)
    sub = ShmSubscriber(run_dir, timeout_s=30)
    target = {k: torch.zeros_like(v) for k, v in _model().items()}
    assert sub.apply(target) is not None and sub.stats.mapped == len(target)
    open(ready, "w").close()
    time.sleep(120)


def test_a_killed_readers_file_is_reused(tmp_path, procs):
    """Nothing to reclaim: the kernel closes a SIGKILLed reader's files, and the publisher's
    next check finds the file free."""
    run_dir = str(tmp_path / "run")
    pub = ShmPublisher(run_dir, _model())
    pub.publish(0, _model())
    first = _inode(pub, 0)
    ready = str(tmp_path / "ready")
    p = mp.get_context("spawn").Process(target=_holding_reader, args=(run_dir, ready), daemon=True)
    p.start()
    procs.append(p)
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        assert time.monotonic() < deadline and p.is_alive(), "reader did not start"
        time.sleep(0.05)
    seen = set()
    for v in range(1, 8):
        pub.publish(v, _model(v))
        seen.add(_inode(pub, v))
    assert first not in seen  # held by the live reader
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    for v in range(8, 12):
        pub.publish(v, _model(v))
        seen.add(_inode(pub, v))
    assert first in seen and pub.skipped == 0
    pub.close()


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
    pub = ShmPublisher(str(tmp_path), weights)
    with torch.inference_mode():  # as if (re)attached mid-generation: its views must stay normal
        sub = ShmSubscriber(str(tmp_path), timeout_s=5)
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


# ---- shm, several processes ----------------------------------------------------------------------

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
        sub = files.ShmSubscriber(run_dir, timeout_s=30)
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
            # keep computing with version v while the publisher moves on: the file it is
            # mapped from is open here, so it must not be reused (a writer blind to readers
            # would reuse it within three publishes)
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
    pub = files.ShmPublisher(run_dir, _versioned(0))
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
    assert skipped == 0  # a publish never has to skip: a new file when every spare is held
    mapper, copier = results
    assert mapper["mapped"] == len(state) and copier["mapped"] == 0  # both modes ran
    assert mapper["changed"] == [], f"mapped weights changed while held: {mapper['changed'][:5]}"
    assert mapper["held"] and max(mapper["held"]) >= 2, "the publisher never moved on during a hold"
    assert all(len(r["applied"]) >= 2 for r in results)
    print("applies per reader:", [len(r["applied"]) for r in results], "publishes during holds:", mapper["held"])


# ---- filesystem ---------------------------------------------------------------------------------


def test_filesystem_roundtrip_keeps_newest_three(tmp_path):
    run_dir = str(tmp_path)
    params = _model()
    params["tied"] = params["w"]  # shared storage, as tied embeddings are
    pub = make_publisher(_cfg("filesystem"), run_dir, params)
    assert isinstance(pub, FsPublisher) and pub.dir == files.weights_dir(run_dir)
    made = make_subscriber(_cfg("filesystem"), run_dir, timeout_s=5)
    assert isinstance(made, FsSubscriber)
    made.close()
    sub = FsSubscriber(run_dir, timeout_s=5, poll_s=0)  # no re-read interval: deterministic test
    target = {k: torch.zeros_like(v) for k, v in params.items()}
    assert sub.latest_version() == -1 and sub.apply(target) is None
    for v in range(5):
        pub.publish(v, params if v < 4 else _model(seed=v) | {"tied": _model(seed=v)["w"]})
    assert _versions(pub.dir) == [2, 3, 4]
    with open(os.path.join(pub.dir, files.LATEST)) as f:
        assert f.read() == "v4\n"
    assert sub.latest_version() == 4
    assert sub.apply(target) == 4 and sub.stats.mapped == 0  # a network file system: copied
    assert all(_same_bits(target[k], _model(seed=4)[k]) for k in _model())
    assert sub.apply(target) is None
    pub.publish(5, params)
    assert sub.latest_version() == 5 and sub.apply(target) == 5
    assert _same_bits(target["emb"], params["emb"])
    assert sorted(os.listdir(pub.dir)) == ["LATEST", "v3", "v4", "v5"]  # no temporary left
    assert os.stat(pub.dir).st_mode & 0o777 == 0o700
    pub.close()
    pub.close()
    sub.close()


def test_filesystem_late_joiner(tmp_path):
    run_dir = str(tmp_path)
    with pytest.raises(TimeoutError, match="weights"):
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
    restarted = FsPublisher(run_dir, _versioned(0))  # a restarted learner starts from a clean directory
    assert _versions(restarted.dir) == []
    restarted.close()


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
