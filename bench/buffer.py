"""Replay-buffer throughput against a bare ZeroMQ pipe, measured side by side in one run.

buffer: ActorClient (this process) -> BufferServer (subprocess: persist on, fsync=batch,
        dedup, validation, staleness policy) -> LearnerClient (subprocess: samples batches and
        sends Consumed for each), configured as ``python run.py`` runs them: on one host,
        ``buffer.by_ref``. The actor stages each group in its slot under run_dir and sends a
        GroupRef; the buffer reads, checks and validates the bytes and copies them into its
        segment log; the learner reads its batches from there. Also run with fsync=never, to
        separate disk from CPU, and ``inline`` (by_ref off: every byte over the sockets, as for
        actors and learners on other hosts).
bare:   the same encoded group bytes, PUSH (this process) -> PULL (subprocess), nothing else.

Timing is the same for both: the clock starts at the first send, once every process is up, and
stops when the receiving process holds the last group. Runs are interleaved (bare, buffer,
buffer-never, bare, ...) so load from other processes hits all paths alike, the page cache is
synced before each run, and the median of ``--repeats`` is reported. Groups are realistic:
8 completions x 1,024 tokens with int32 ids, float32 log-probs, int32 versions (~98 KB encoded).

Knobs that are part of the comparison, not tuning of it:
* ``--window`` (default 64): groups an actor keeps in flight. With fsync on, an ack needs the
  disk's round trip (~2-5 ms here), so the window must cover groups-per-second x that latency,
  as any acked pipe must; the bare PUSH socket queues up to 1,000 messages without any ack.
* ``--batch`` (default ``learner.groups_per_step``): groups per ``LearnerClient.sample()``,
  what the learner asks for once per optimiser step.
* ``--send-batch`` (default ``actor.groups_per_batch``): groups per ``ActorClient.send_many``,
  what an actor hands over after generating one batch.

Each run also records the CPU seconds every process of the path spent between the first send
and the last receive (this process via getrusage, the others via /proc), so the table shows what
each path costs the machine per group, not just how fast it went. Then each step the buffer adds
is timed alone on one core. The last line is one JSON object: {"bench": "buffer", "ratio": ...}.

    python bench/buffer.py [--groups 5000] [--window 64] [--batch 16] [--repeats 5]
    python bench/buffer.py --disk-check     # synced writes of group-sized records alone

BENCH_PROFILE_DIR=DIR runs every subprocess under cProfile, writing DIR/*.prof.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import crc32c  # noqa: E402
import msgspec  # noqa: E402
import zmq  # noqa: E402

from bench.common import CpuMeter, load_avg  # noqa: E402
from buffer.client import ActorClient, LearnerClient  # noqa: E402
from buffer.persist import SegmentLog  # noqa: E402
from buffer.store import entry_from_group  # noqa: E402
from buffer.synth import make_group  # noqa: E402
from core import config as C  # noqa: E402
from core import net  # noqa: E402
from core.messages import ACTOR_TO_BUFFER_VIEW, decoder, encode, validate_group  # noqa: E402

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


def _watchdog(procs: list, done: threading.Event) -> None:
    """ActorClient.send() blocks while the buffer answers busy: if a helper process dies, the
    run would hang forever, so end the bench with the reason instead."""
    def watch():
        while not done.wait(0.5):
            for p in procs:
                if p.poll() not in (None, 0):
                    print(f"bench: {' '.join(p.args[1:4])} exited with {p.returncode}", file=sys.stderr)
                    for q in procs:
                        if q.poll() is None:
                            q.kill()
                    os._exit(2)
    threading.Thread(target=watch, daemon=True).start()


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread, ZeroMQ's I/O thread included
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    """CPU seconds of another live process (Linux /proc); NaN where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


# ---- receiving ends (subprocesses) -------------------------------------------------------------


def consumer(config: str, n: int, batch: int, run_dir: str, by_ref: bool) -> None:
    with open(config, "rb") as f:
        cfg = C.from_json(f.read())
    client = LearnerClient(cfg, learner_id="bench", run_dir=run_dir, by_ref=by_ref)
    print("ready", flush=True)
    got, cpu0 = 0, None
    while got < n:
        b = client.sample(min(batch, n - got), 0, timeout_s=60)
        if b is None:
            raise SystemExit(f"consumer: timed out after {got}/{n} groups")
        if cpu0 is None:  # from the first batch on: the start-up is nobody's throughput
            cpu0 = _self_cpu()
        got += len(b.groups)
        client.consumed([g.key for g in b.groups], 0)
    end = time.time()
    cpu = _self_cpu() - cpu0
    client.close()
    print(json.dumps({"end": end, "groups": got, "cpu_s": cpu}))


def puller(port: int, n: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.connect(f"tcp://127.0.0.1:{port}")
    print("ready", flush=True)
    nbytes, cpu0 = 0, None
    for _ in range(n):
        nbytes += len(s.recv(copy=False))
        if cpu0 is None:
            cpu0 = _self_cpu()
    print(json.dumps({"end": time.time(), "bytes": nbytes, "cpu_s": _self_cpu() - cpu0}))


# ---- sending ends (this process) ---------------------------------------------------------------


def run_buffer(args, groups, fsync: str, by_ref: bool = True) -> dict:
    os.sync()  # the previous run's dirty pages must not be written back on this run's clock
    with tempfile.TemporaryDirectory() as run_dir, CpuMeter() as meter:
        cfg = _cfg(args, run_dir, fsync)
        server = _spawn("-m", "buffer.server", "--config", os.path.join(run_dir, "config.json"),
                        "--run-dir", run_dir)
        cons = _spawn(__file__, "--role", "consumer", "--config", os.path.join(run_dir, "config.json"),
                      "--groups", str(args.groups), "--batch", str(args.batch), "--run-dir", run_dir,
                      "--by-ref", str(int(by_ref)))
        done = threading.Event()
        _watchdog([server, cons], done)
        try:
            cons.stdout.readline()  # "ready"
            client = ActorClient(cfg, "bench", window=args.window, run_dir=run_dir, by_ref=by_ref)
            seq0 = client.next_seq()  # waits for the buffer's Hello answer: the server is up
            server_cpu0, cpu0, t0 = _proc_cpu(server.pid), _self_cpu(), time.time()
            for i in range(0, args.groups, args.send_batch):  # as an actor hands over a finished batch
                client.send_many([msgspec.structs.replace(groups[j % TEMPLATES], seq=seq0 + j)
                                  for j in range(i, min(i + args.send_batch, args.groups))])
            assert client.flush(60), "buffer never acked everything"
            res = _finish(cons)
            cpu = {"actor": _self_cpu() - cpu0, "server": _proc_cpu(server.pid) - server_cpu0,
                   "learner": res["cpu_s"]}
            client.close()
        finally:
            done.set()
            for p in (cons, server):
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)
    return {"s": res["end"] - t0, "cpu": cpu, "foreign_cores": meter.result["foreign_cores"]}


def run_bare(args, frames) -> dict:
    os.sync()
    with CpuMeter() as meter:
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        pull = _spawn(__file__, "--role", "puller", "--port", str(port), "--groups", str(args.groups))
        pull.stdout.readline()  # "ready"
        cpu0, t0 = _self_cpu(), time.time()
        for i in range(args.groups):
            s.send(frames[i % TEMPLATES], copy=False)
        res = _finish(pull)
        cpu = {"pusher": _self_cpu() - cpu0, "puller": res["cpu_s"]}
        s.close(linger=0)
        ctx.term()
    return {"s": res["end"] - t0, "cpu": cpu, "foreign_cores": meter.result["foreign_cores"]}


# ---- single-core cost of each step the buffer adds ---------------------------------------------


def _per_group_us(fn, items, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x in items:
            fn(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(items) * 1e6


def stage_costs(groups, window: int) -> dict:
    """What each step costs per group on one core, and the durable log's ceiling on this disk."""
    frames = [encode(g) for g in groups]
    dec = decoder(ACTOR_TO_BUFFER_VIEW)  # as the server decodes: arrays stay views
    out = {
        "decode": _per_group_us(dec.decode, frames),
        "validate_group": _per_group_us(validate_group, groups),
        "metadata": _per_group_us(lambda g: entry_from_group(g, b""), groups),
        "crc32c": _per_group_us(crc32c.crc32c, frames),
    }
    # the log in its steady state, as a run drives it: every group consumed soon after, so
    # segments are deleted and their files recycled (warm-up pass first, then the timed one)
    stream = [frames[i % len(frames)] for i in range(1024)]  # ~100 MB: several 16 MB segments
    seg = C.Config().buffer.segment_bytes
    for fsync in ("never", "batch"):
        os.sync()  # start from a clean page cache, as the end-to-end runs do
        with tempfile.TemporaryDirectory() as d:
            log = SegmentLog(d, seg, fsync=fsync)
            log.open(dict)
            n = 0

            def turn(batch):  # group commit as the server drives it: one turn's groups, then hand over
                nonlocal n
                keys = []
                for f in batch:
                    n += 1
                    keys.append(("bench", n))
                    log.append_group(keys[-1], f)
                log.commit(wait=False)
                log.append_done(keys, "consumed")
                log.gc()
            turns = [stream[i:i + window] for i in range(0, len(stream), window)]
            for timed in (False, True):
                t0 = time.perf_counter()
                for t in turns:
                    turn(t)
                log.commit()  # waits until the I/O thread has written (and synced) everything
                if timed:
                    out["log_append" if fsync == "never" else "durable_log"] = \
                        (time.perf_counter() - t0) / len(stream) * 1e6
            log.close()
    return {k: round(v, 1) for k, v in out.items()}


def disk_check(group_bytes: int, n: int = 2000, turn: int = 64) -> dict:
    """Synced writes of group-sized records on this disk, two ways: buffered + fdatasync per turn
    (what the segment log does) and O_DIRECT (no page cache), plus the CPU to read O_DIRECT
    records back (they are not cached). ``--disk-check`` prints it; the run is ~1 s."""
    import mmap

    size = -(-group_bytes // 4096) * 4096  # O_DIRECT wants block-aligned lengths and offsets
    buf = mmap.mmap(-1, size)  # page-aligned memory, as O_DIRECT wants
    buf.write(os.urandom(size))
    out = {}
    with tempfile.TemporaryDirectory(dir=ROOT) as d:  # the disk runs live on, not a tmpfs
        for name, flags in (("buffered", 0), ("o_direct", os.O_DIRECT)):
            path = os.path.join(d, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
            os.posix_fallocate(fd, 0, n * size)
            t0, cpu0 = time.perf_counter(), _self_cpu()
            for i in range(n):
                os.pwrite(fd, buf, i * size)
                if i % turn == turn - 1:
                    os.fdatasync(fd)
            os.fdatasync(fd)
            secs, cpu = time.perf_counter() - t0, _self_cpu() - cpu0
            os.close(fd)
            out[name] = {"mb_per_s": round(n * size / secs / 1e6), "cpu_us_per_group": round(cpu / n * 1e6, 1)}
        fd = os.open(os.path.join(d, "o_direct"), os.O_RDONLY)
        cpu0 = _self_cpu()
        for i in range(n):
            os.pread(fd, size, i * size)
        out["o_direct"]["read_back_cpu_us_per_group"] = round((_self_cpu() - cpu0) / n * 1e6, 1)
        os.close(fd)
    return out


# ---- main ---------------------------------------------------------------------------------------


def _us_per_group(cpu: dict, groups: int) -> dict:
    return {k: round(v / groups * 1e6, 1) for k, v in cpu.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", choices=["main", "consumer", "puller"])
    ap.add_argument("--groups", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=C.Config().learner.groups_per_step,
                    help="groups per SampleRequest (default: learner.groups_per_step)")
    ap.add_argument("--window", type=int, default=64, help="ActorClient in-flight window")
    ap.add_argument("--send-batch", type=int, default=C.Config().actor.groups_per_batch,
                    help="groups per ActorClient.send_many (default: actor.groups_per_batch)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--fsync", default="batch", choices=["always", "batch", "never"])
    ap.add_argument("--disk-check", action="store_true",
                    help="only measure synced writes of group-sized records: buffered vs O_DIRECT")
    ap.add_argument("--config")
    ap.add_argument("--port", type=int)
    ap.add_argument("--run-dir")
    ap.add_argument("--by-ref", type=int, default=1)
    args = ap.parse_args()
    if args.role == "consumer":
        return consumer(args.config, args.groups, args.batch, args.run_dir, bool(args.by_ref))
    if args.role == "puller":
        return puller(args.port, args.groups)
    if args.disk_check:
        size = len(encode(make_group("bench", 0, completions=args.completions, tokens=args.tokens, ragged=False)))
        res = disk_check(size)
        for k, v in res.items():
            print(f"{k:<10}" + "  ".join(f"{a} {b}" for a, b in v.items()))
        print(json.dumps({"bench": "buffer_disk", "group_bytes": size, **res}))
        return None

    groups = [make_group("bench", i, completions=args.completions, tokens=args.tokens, ragged=False)
              for i in range(TEMPLATES)]
    frames = [encode(g) for g in groups]
    main_row = f"buffer (fsync={args.fsync})"
    paths = {"bare": lambda: run_bare(args, frames), main_row: lambda: run_buffer(args, groups, args.fsync)}
    if args.fsync != "never":
        paths["buffer (fsync=never)"] = lambda: run_buffer(args, groups, "never")
    paths[f"inline (fsync={args.fsync})"] = lambda: run_buffer(args, groups, args.fsync, by_ref=False)
    load_before = load_avg()[0]
    runs = {k: [] for k in paths}
    for _ in range(args.repeats):  # interleaved, so load from other processes hits all alike
        for k, run in paths.items():
            runs[k].append(run())
    load_after = load_avg()[0]
    secs = {k: statistics.median(r["s"] for r in v) for k, v in runs.items()}
    cpu = {k: {p: statistics.median(r["cpu"][p] for r in v) for p in v[0]["cpu"]} for k, v in runs.items()}
    foreign = statistics.median(r["foreign_cores"] for v in runs.values() for r in v)
    mb = sum(len(frames[i % TEMPLATES]) for i in range(args.groups)) / 1e6
    gps = {k: args.groups / s for k, s in secs.items()}
    costs = stage_costs(groups, args.window)
    disk_mb_s = mb / args.groups / (costs["durable_log"] * 1e-6)

    print(f"{args.groups} groups x {args.completions} completions x {args.tokens} tokens "
          f"({mb / args.groups * 1e3:.0f} KB each), window {args.window}, batch {args.batch}, "
          f"median of {args.repeats}; load {load_before:.2f} -> {load_after:.2f}, "
          f"other work took {foreign:.2f} cores during the runs")
    print(f"{'path':<24}{'groups/s':>10}{'MB/s':>8}{'seconds':>9}{'ratio':>7}{'CPU us/group':>14}"
          "  by process")
    for k in paths:
        per = _us_per_group(cpu[k], args.groups)
        print(f"{k:<24}{gps[k]:>10.0f}{mb / secs[k]:>8.0f}{secs[k]:>9.2f}{gps[k] / gps['bare']:>7.3f}"
              f"{sum(per.values()):>14.0f}  " + " ".join(f"{p} {v:.0f}" for p, v in per.items()))
    print("\nwhat the buffer adds per group, one core, in-process "
          f"(bare pipe: {1e6 / gps['bare']:.0f} us/group):")
    for k, v in costs.items():
        print(f"  {k:<16}{v:>8.1f} us")
    print(f"durable log alone, steady state (append + group commit, {args.window}-group turns): {disk_mb_s:.0f} MB/s "
          f"= {disk_mb_s / (mb / secs['bare']):.3f} of the bare pipe")
    never = gps.get("buffer (fsync=never)", gps[main_row])
    print(json.dumps({
        "bench": "buffer", "ratio": round(gps[main_row] / gps["bare"], 3),
        "buffer_groups_per_s": round(gps[main_row], 1), "bare_groups_per_s": round(gps["bare"], 1),
        "buffer_mb_per_s": round(mb / secs[main_row], 1), "bare_mb_per_s": round(mb / secs["bare"], 1),
        "ratio_fsync_never": round(never / gps["bare"], 3),
        "ratio_inline": round(gps[f"inline (fsync={args.fsync})"] / gps["bare"], 3),
        "cpu_us_per_group": {k: _us_per_group(v, args.groups) for k, v in cpu.items()},
        "seconds": {k: [round(r["s"], 3) for r in v] for k, v in runs.items()},
        "disk_mb_per_s": round(disk_mb_s, 1), "ratio_ceiling_disk": round(disk_mb_s / (mb / secs["bare"]), 3),
        "load_before": round(load_before, 2), "load_after": round(load_after, 2),
        "foreign_cores": round(foreign, 2),
        "groups": args.groups, "group_kb": round(mb / args.groups * 1e3, 1), "window": args.window,
        "batch": args.batch, "persist": True, "fsync": args.fsync, "stage_us": costs,
    }))


if __name__ == "__main__":
    main()
