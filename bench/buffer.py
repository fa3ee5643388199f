"""Replay-buffer throughput against a bare ZeroMQ pipe, measured side by side in one run.

buffer: ActorClient (this process) -> BufferServer (subprocess: persist on, fsync=batch,
        dedup, validation, staleness policy) -> LearnerClient (subprocess: samples batches and
        sends Consumed for each). Also run with fsync=never, to separate disk from CPU.
bare:   the same encoded group bytes, PUSH (this process) -> PULL (subprocess), nothing else.

Both clocks run from the first send to the moment the receiving process holds the last group.
Groups are realistic: 8 completions x 1,024 tokens with int32 ids, float32 log-probs, int32
versions (~98 KB encoded). Then each step the buffer adds is timed alone on one core, and the
durable-log bandwidth (append + one fsync per window of groups) gives the ceiling of the ratio.
The last line is one JSON object: {"bench": "buffer", "ratio": ...}.

    python bench/buffer.py [--groups 3000] [--window 8] [--batch 8] [--repeats 3]

BENCH_PROFILE_DIR=DIR runs every subprocess under cProfile, writing DIR/*.prof.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import msgspec  # noqa: E402
import zmq  # noqa: E402

from buffer.client import ActorClient, LearnerClient  # noqa: E402
from buffer.persist import SegmentLog  # noqa: E402
from buffer.store import entry_from_group  # noqa: E402
from buffer.synth import make_group  # noqa: E402
from core import config as C  # noqa: E402
from core import net  # noqa: E402
from core.messages import ACTOR_TO_BUFFER, decoder, encode, validate_group  # noqa: E402

TEMPLATES = 32


def _cfg(args, run_dir: str, fsync: str) -> C.Config:
    cfg = C.load(None, [
        f"net.buffer_actor_port={net.free_port()}", f"net.buffer_learner_port={net.free_port()}",
        "buffer.persist=true", f"buffer.fsync=\"{fsync}\"", f"buffer.max_staleness={10**6}",
    ])
    with open(os.path.join(run_dir, "config.json"), "wb") as f:
        f.write(C.to_json(cfg))
    return cfg


def _spawn(*argv) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    prof = os.environ.get("BENCH_PROFILE_DIR")  # cProfile each subprocess, for optimisation work
    if prof:
        argv = ("-m", "cProfile", "-o", os.path.join(prof, f"{os.getpid()}-{time.time_ns()}.prof"), *argv)
    return subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


# ---- receiving ends (subprocesses) -------------------------------------------------------------


def consumer(config: str, n: int, batch: int) -> None:
    with open(config, "rb") as f:
        cfg = C.from_json(f.read())
    client = LearnerClient(cfg, learner_id="bench")
    print("ready", flush=True)
    got = 0
    while got < n:
        b = client.sample(min(batch, n - got), 0, timeout_s=60)
        if b is None:
            raise SystemExit(f"consumer: timed out after {got}/{n} groups")
        got += len(b.groups)
        client.consumed([g.key for g in b.groups], 0)
    end = time.time()
    client.close()
    print(json.dumps({"end": end, "groups": got}))


def puller(port: int, n: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.connect(f"tcp://127.0.0.1:{port}")
    print("ready", flush=True)
    nbytes = 0
    for _ in range(n):
        nbytes += len(s.recv(copy=False))
    print(json.dumps({"end": time.time(), "bytes": nbytes}))


# ---- sending ends (this process) ---------------------------------------------------------------


def run_buffer(args, groups, fsync: str) -> dict:
    os.sync()  # the previous run's dirty pages must not be written back on this run's clock
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = _cfg(args, run_dir, fsync)
        server = _spawn("-m", "buffer.server", "--config", os.path.join(run_dir, "config.json"),
                        "--run-dir", run_dir)
        cons = _spawn(__file__, "--role", "consumer", "--config", os.path.join(run_dir, "config.json"),
                      "--groups", str(args.groups), "--batch", str(args.batch))
        try:
            client = ActorClient(cfg, "bench", window=args.window)
            seq0 = client.next_seq()  # waits for the buffer's Hello answer: the server is up
            t0 = time.time()
            for i in range(args.groups):
                client.send(msgspec.structs.replace(groups[i % TEMPLATES], seq=seq0 + i))
            assert client.flush(60), "buffer never acked everything"
            res = _finish(cons)
            client.close()
        finally:
            for p in (cons, server):
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)
        nbytes = sum(len(encode(groups[i % TEMPLATES])) for i in range(args.groups))
        return {"s": res["end"] - t0, "bytes": nbytes, "admission_wait_s": client.admission_wait_s}


def run_bare(args, frames) -> dict:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    pull = _spawn(__file__, "--role", "puller", "--port", str(port), "--groups", str(args.groups))
    pull.stdout.readline()  # "ready"
    t0 = time.time()
    for i in range(args.groups):
        s.send(frames[i % TEMPLATES], copy=False)
    res = _finish(pull)
    s.close(linger=0)
    ctx.term()
    return {"s": res["end"] - t0, "bytes": res["bytes"]}


def _per_group_us(fn, items, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x in items:
            fn(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(items) * 1e6


def stage_costs(groups, window: int) -> dict:
    """Single-core cost of each step the buffer adds per group, to show what limits the ratio."""
    frames = [encode(g) for g in groups]
    dec = decoder(ACTOR_TO_BUFFER)
    out = {
        "decode": _per_group_us(dec.decode, frames),
        "validate_group": _per_group_us(validate_group, groups),
        "metadata": _per_group_us(lambda g: entry_from_group(g, b""), groups),
    }
    stream = [frames[i % len(frames)] for i in range(512)]  # ~50 MB: several 16 MB segments
    seg = C.Config().buffer.segment_bytes
    for fsync in ("never", "batch"):
        os.sync()  # start from clean page cache, as the end-to-end runs do
        with tempfile.TemporaryDirectory() as d:
            log = SegmentLog(d, seg, fsync=fsync)
            log.open(dict)
            if fsync == "never":
                out["log_append"] = _per_group_us(lambda f: log.append_group(("bench", 0), f), stream, 1)
            else:
                def turn(batch):
                    for f in batch:
                        log.append_group(("bench", 0), f)
                    log.commit()
                turns = [stream[i:i + window] for i in range(0, len(stream), window)]
                out["fsync_per_group"] = _per_group_us(turn, turns, 1) / window - out["log_append"]
            log.close()
    return {k: round(v, 1) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", choices=["main", "consumer", "puller"])
    ap.add_argument("--groups", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=8, help="groups per SampleRequest")
    ap.add_argument("--window", type=int, default=8, help="ActorClient in-flight window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--fsync", default="batch", choices=["always", "batch", "never"])
    ap.add_argument("--config")
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.role == "consumer":
        return consumer(args.config, args.groups, args.batch)
    if args.role == "puller":
        return puller(args.port, args.groups)

    groups = [make_group("bench", i, completions=args.completions, tokens=args.tokens, ragged=False)
              for i in range(TEMPLATES)]
    frames = [encode(g) for g in groups]
    paths = {"bare": lambda: run_bare(args, frames),
             f"buffer (fsync={args.fsync})": lambda: run_buffer(args, groups, args.fsync)}
    if args.fsync != "never":
        paths["buffer (fsync=never)"] = lambda: run_buffer(args, groups, "never")
    rows = {k: [] for k in paths}
    for _ in range(args.repeats):  # interleaved, so load from other processes hits all alike
        for k, run in paths.items():
            rows[k].append(run()["s"])
    secs = {k: statistics.median(v) for k, v in rows.items()}
    mb = sum(len(frames[i % TEMPLATES]) for i in range(args.groups)) / 1e6
    gps = {k: args.groups / s for k, s in secs.items()}
    main_row = f"buffer (fsync={args.fsync})"
    costs = stage_costs(groups, args.window)
    disk_mb_s = mb / args.groups / ((costs["log_append"] + costs["fsync_per_group"]) * 1e-6)

    print(f"{args.groups} groups x {args.completions} completions x {args.tokens} tokens "
          f"({mb / args.groups * 1e3:.0f} KB each), window {args.window}, batch {args.batch}, "
          f"median of {args.repeats}")
    print(f"{'path':<24}{'groups/s':>10}{'MB/s':>8}{'seconds':>9}{'ratio':>7}")
    for k in paths:
        print(f"{k:<24}{gps[k]:>10.0f}{mb / secs[k]:>8.0f}{secs[k]:>9.2f}{gps[k] / gps['bare']:>7.3f}")
    print("\nwhat the buffer adds per group, one core, in-process "
          f"(bare pipe: {1e6 / gps['bare']:.0f} us/group):")
    for k, v in costs.items():
        print(f"  {k:<16}{v:>8.1f} us")
    print(f"durable log bandwidth (append + fsync per {args.window}-group turn): {disk_mb_s:.0f} MB/s "
          f"= {disk_mb_s / (mb / secs['bare']):.3f} of the bare pipe: the ceiling of the ratio with fsync on")
    never = gps.get("buffer (fsync=never)", gps[main_row])
    print(json.dumps({
        "bench": "buffer", "ratio": round(gps[main_row] / gps["bare"], 3),
        "buffer_groups_per_s": round(gps[main_row], 1), "bare_groups_per_s": round(gps["bare"], 1),
        "buffer_mb_per_s": round(mb / secs[main_row], 1), "bare_mb_per_s": round(mb / secs["bare"], 1),
        "ratio_fsync_never": round(never / gps["bare"], 3),
        "disk_mb_per_s": round(disk_mb_s, 1), "ratio_ceiling_disk": round(disk_mb_s / (mb / secs["bare"]), 3),
        "groups": args.groups, "group_kb": round(mb / args.groups * 1e3, 1), "window": args.window,
        "batch": args.batch, "persist": True, "fsync": args.fsync, "stage_us": costs,
    }))


if __name__ == "__main__":
    main()
