"""Is the replay buffer ever the bottleneck? Its CPU per learner step and its durable store against
the raw disk, both measured in one run.

(a) CPU. The buffer's whole path runs as ``python run.py`` runs it, paced like the default job:
    every learner step the actor (this process) hands ``learner.groups_per_step`` groups to its
    ActorClient (encode, spool file, send, acks); the BufferServer (``python -m buffer.server``,
    persist on, fsync=batch: decode, validate, dedup, SQLite store, forward) passes them on; a
    LearnerClient (a subprocess: request, reassembly, Consumed) takes them, then sleeps one
    learner step (the training: the learner's compute is not the buffer's). The CPU seconds each
    process spent meanwhile, every thread counted (getrusage; /proc for the server), per group
    and per step: ``cpu_frac_of_step`` = buffer CPU per step / :func:`learner_step_s` at the
    default job (target <= 0.02). Two loads at that pace: the default job's group (8 completions
    of up to 8 tokens after a 7-token prompt), the headline, and a long-sequence group
    (8 x 1,024 tokens; against the default job's step an upper bound: a job with such groups
    has a far longer learner step).
(b) Disk. The buffer's store alone (``buffer/durable.py``: SQLite, WAL, fsync=batch), driven as
    the server drives it: per loop turn ``MAX_BATCH_MSGS`` groups added, the previous turn's
    marked trained and covered by a checkpoint (their bytes dropped), one commit; against the raw
    disk in the same run, on the same file system: the same bytes appended with an fdatasync per
    turn. Each is timed on a second pass after ``os.sync()``; the median of ``--repeats``.
    ``store_headroom``: the groups per second the store keeps durable (the default group) over the
    groups per second the default job's learner consumes (target >= 10: the store is never the
    bottleneck). ``store_vs_disk`` (the long group's MB/s over the raw disk's) is reported, not a
    target: SQLite writes each page twice (WAL, then checkpoint) and pays per row where raw
    writes pay one call; the store was chosen for its integrity checks and recovery, not speed.

(c) The floor. The same three processes exchanging the same messages (frames of the same sizes, the
    same pacing) over bare ZeroMQ sockets, doing nothing else: ``floor_frac_of_step`` is what the
    transport alone costs (the processes' wake-ups, ZeroMQ's I/O threads, the kernel's TCP), the part
    of ``cpu_frac_of_step`` no change to the buffer's own code can remove.

The last stdout line is one JSON object: {"bench": "buffer", "cpu_frac_of_step": ..., "floor_frac_of_step":
..., "store_headroom": ..., "store_vs_disk": ..., ...raw figures}.

    python bench/buffer.py [--steps 40] [--learner-step-ms MS] [--dir DIR]
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

import msgspec  # noqa: E402
import zmq  # noqa: E402

from bench.common import format_table, load_avg  # noqa: E402
from buffer.client import ActorClient, LearnerClient  # noqa: E402
from buffer.durable import DurableStore  # noqa: E402
from buffer.server import MAX_BATCH_MSGS  # noqa: E402
from core import config as C  # noqa: E402
from core import net  # noqa: E402
from core.messages import Ack, Acks, Consumed, SampleBatch, SampleRequest, encode  # noqa: E402
from tests.support.synth import make_group  # noqa: E402

TEMPLATES = 32
MAX_RECORDS = 20_000  # per pass of the store / disk check: small records are CPU-bound, not disk-bound
LOADS = {  # name -> make_group arguments
    "default": dict(completions=8, tokens=8, prompt_tokens=7),  # the default job's group
    "long": dict(completions=8, tokens=1024, prompt_tokens=32, ragged=False),
}


def learner_step_s(steps: int = 5) -> float:
    """Median seconds of one learner step (collate + forward/backward + optimiser step) at the
    default job: the default config's tiny base model (built once and cached, as ``python run.py``
    does), ``learner.groups_per_step`` groups of ``actor.group_size`` completions sampled by the
    actor's engine, ``learner.threads`` torch threads. The only function here that touches the
    model, actor and learner APIs."""
    import torch

    from bench.common import engine_batch, resolved_config
    from learner.backends import make_backend

    cfg = resolved_config()
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(0)
    batch = engine_batch(cfg)
    backend = make_backend(cfg, cfg.model.path)
    times = []
    for _ in range(steps + 1):  # the first step pays one-off allocations
        t0 = time.perf_counter()
        backend.step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# ---- plumbing -------------------------------------------------------------------------------------


def _cfg(run_dir: str) -> tuple[C.Config, str]:
    cfg = C.load(None, [f"net.buffer_actor_port={net.free_port()}", f"net.buffer_learner_port={net.free_port()}",
                        "buffer.persist=true", 'buffer.fsync="batch"', f"buffer.max_staleness={10**6}",
                        # the buffer admits completions up to max_new_tokens: the long load's length
                        f"actor.max_new_tokens={max(kw['tokens'] for kw in LOADS.values())}",
                        "model.max_position_embeddings=2048"])  # (a config rule: room for a prompt)
    path = os.path.join(run_dir, "config.json")
    with open(path, "wb") as f:
        f.write(C.to_json(cfg))
    return cfg, path


def _spawn(*argv, stderr=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            cwd=ROOT)


def _watchdog(procs: list, done: threading.Event) -> None:
    """ActorClient.send() blocks while the buffer does not answer: if a helper process dies, end
    the bench with the reason instead of hanging."""
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
    """CPU seconds of another live process, its threads summed: Linux schedstat, in ns (the
    utime/stime of /proc/PID/stat count 10 ms ticks, too coarse for a few ms per step)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


# ---- (a) CPU of the whole path, paced like the default job ----------------------------------------


def learner_role(config: str, steps: int, step_s: float) -> None:
    """The learner's side (a subprocess): per step, take a batch, "train", report it consumed."""
    with open(config, "rb") as f:
        cfg = C.from_json(f.read())
    per_step = cfg.learner.groups_per_step
    client = LearnerClient(cfg, learner_id="bench")
    print("ready", flush=True)
    cpu0 = _self_cpu()
    for _ in range(steps):
        got = []
        while len(got) < per_step:
            b = client.sample(per_step - len(got), 0, timeout_s=60)
            if b is None:
                raise SystemExit(f"learner: timed out with {len(got)}/{per_step} groups")
            got += b.groups
        time.sleep(step_s)  # the training step: the learner's compute, not the buffer's
        client.consumed([g.key for g in got], 0)
    cpu = _self_cpu() - cpu0
    client.close()
    print(json.dumps({"cpu_s": cpu}))


def paced_run(templates: list, steps: int, step_s: float, work: str) -> dict:
    """CPU seconds of the actor client, the server and the learner client over ``steps`` steps."""
    per_step = C.Config().learner.groups_per_step
    with tempfile.TemporaryDirectory(dir=work) as run_dir:
        cfg, path = _cfg(run_dir)
        with open(os.path.join(work, "server.log"), "w") as log:  # its INFO lines, kept out of the table
            server = _spawn("-m", "buffer.server", "--config", path, "--run-dir", run_dir, stderr=log)
        learner = _spawn(__file__, "--role", "learner", "--config", path, "--steps", str(steps),
                         "--step-s", str(step_s))
        done = threading.Event()
        _watchdog([server, learner], done)
        try:
            learner.stdout.readline()  # "ready"
            actor = ActorClient(cfg, "bench", run_dir=run_dir)  # with its spool, as in a run
            seq0 = actor.next_seq()  # waits for the buffer's Hello answer: the server is up
            groups = [msgspec.structs.replace(templates[j % len(templates)], seq=seq0 + j)
                      for j in range(steps * per_step)]
            cpu0, server0, t0 = _self_cpu(), _proc_cpu(server.pid), time.monotonic()
            for s in range(steps):
                time.sleep(max(0.0, t0 + s * step_s - time.monotonic()))
                actor.send_many(groups[s * per_step:(s + 1) * per_step])
            assert actor.flush(60), "the buffer never acked everything"
            cpu = {"actor": _self_cpu() - cpu0}
            out, _ = learner.communicate(timeout=120)
            cpu["server"] = _proc_cpu(server.pid) - server0
            cpu["learner"] = json.loads(out.strip().splitlines()[-1])["cpu_s"]
            actor.close()
        finally:
            done.set()
            for p in (learner, server):
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)
    return {"cpu_s": cpu, "groups": len(groups), "wall_s": time.monotonic() - t0}


def cpu_figures(run: dict, steps: int, step_s: float, group_bytes: int) -> dict:
    per_group = {k: v / run["groups"] * 1e6 for k, v in run["cpu_s"].items()}
    per_group["total"] = sum(per_group.values())
    per_step_ms = sum(run["cpu_s"].values()) / steps * 1e3
    return {"group_bytes": group_bytes, "cpu_us_per_group": {k: round(v, 1) for k, v in per_group.items()},
            "cpu_ms_per_step": round(per_step_ms, 3), "cpu_frac_of_step": round(per_step_ms / 1e3 / step_s, 4)}


# ---- (c) the floor: the same messages over bare sockets ------------------------------------------


def _floor_sizes(per_step: int) -> dict:
    """The encoded sizes of the small messages of one step, as the buffer's path makes them."""
    keys = [("bench", i) for i in range(per_step)]
    return {"acks": len(encode(Acks([Ack(*k, "ok") for k in keys]))), "consumed": len(encode(Consumed(keys, 0, 0))),
            "request": len(encode(SampleRequest(1, per_step, 0))), "head": len(encode(SampleBatch(1, [], 0)))}


def floor_server(spec: dict) -> None:
    """A ROUTER for the actor and one for the learner: each actor message acked, each request answered
    with ``per_step`` frames once they have arrived. Nothing decoded, validated or stored."""
    ctx, sizes, per_step = zmq.Context(), spec["sizes"], spec["per_step"]
    actor, learner = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    print(json.dumps([s.bind_to_random_port("tcp://127.0.0.1") for s in (actor, learner)]), flush=True)
    poller, frames, asker, served, cpu0 = zmq.Poller(), [], None, 0, None
    for s in (actor, learner):
        poller.register(s, zmq.POLLIN)
    while served < spec["steps"]:
        ready = dict(poller.poll(1000))
        for sock in (s for s in (learner, actor) if s in ready):
            for msg in _floor_drain(sock):
                cpu0 = _self_cpu() if cpu0 is None else cpu0
                if sock is actor:
                    frames += msg[1:]
                    actor.send_multipart([msg[0], bytes(sizes["acks"])])
                elif len(msg[1]) == sizes["request"]:
                    asker = msg[0]
        if asker is not None and len(frames) >= per_step:
            learner.send_multipart([asker, bytes(sizes["head"]), *frames[:per_step]], copy=False)
            frames, asker, served = frames[per_step:], None, served + 1
    cpu = _self_cpu() - cpu0
    ctx.destroy(linger=5000)  # the last batch leaves before the process does
    print(json.dumps({"cpu_s": cpu}), flush=True)


def _floor_drain(sock):
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


def floor_learner(spec: dict) -> None:
    """A DEALER asking for each step's frames, then a step later saying they were consumed."""
    sock, sizes = zmq.Context().socket(zmq.DEALER), spec["sizes"]
    sock.linger = 0  # its last request is never answered
    sock.connect(f"tcp://127.0.0.1:{spec['port']}")
    sock.send(bytes(sizes["request"]))
    sock.recv_multipart(copy=False)
    cpu0 = _self_cpu()
    for _ in range(spec["steps"] - 1):
        sock.send(bytes(sizes["request"]))
        time.sleep(spec["step_s"])  # training the batch it just got
        sock.send(bytes(sizes["consumed"]))
        sock.recv_multipart(copy=False)
    print(json.dumps({"cpu_s": _self_cpu() - cpu0}), flush=True)


def floor_run(frame: bytes, steps: int, step_s: float) -> dict:
    """(c), with this process the actor: each step's groups sent as one message, its acks read."""
    per_step = C.Config().learner.groups_per_step
    spec = {"steps": steps + 1, "per_step": per_step, "step_s": step_s, "sizes": _floor_sizes(per_step)}
    server = _spawn(__file__, "--role", "floor-server", "--config", json.dumps(spec))
    ports = json.loads(server.stdout.readline())
    learner = _spawn(__file__, "--role", "floor-learner", "--config", json.dumps({**spec, "port": ports[1]}))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{ports[0]}")
    sock.send_multipart([frame] * per_step)  # the first step: connections made, off the clock
    sock.recv()
    cpu0, t0 = _self_cpu(), time.monotonic()
    for s in range(steps):
        time.sleep(max(0.0, t0 + s * step_s - time.monotonic()))
        sock.send_multipart([frame] * per_step)
        sock.recv()
    cpu = {"actor": _self_cpu() - cpu0}
    for name, p in (("server", server), ("learner", learner)):
        cpu[name] = json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1])["cpu_s"]
    sock.close(linger=0)
    return {"cpu_s": cpu, "groups": steps * per_step, "wall_s": time.monotonic() - t0}


# ---- (b) the durable store against the raw disk ----------------------------------------------------


def store_mb_s(frame: bytes, d: str, n: int) -> float:
    """The store in its steady state, turns of MAX_BATCH_MSGS groups as the server's loop makes
    them: add, retire the previous turn's (trained at a step a checkpoint then covers), commit.
    Timed on the second of two passes (SQLite reuses the freed pages)."""
    store, seq = DurableStore(d, fsync="batch"), 0
    try:
        for _ in range(2):
            os.sync()  # no dirty pages of earlier work written back on this clock
            t0, last = time.perf_counter(), []
            for _ in range(0, n, MAX_BATCH_MSGS):
                keys = [("bench", seq + i) for i in range(MAX_BATCH_MSGS)]
                for k in keys:
                    store.add(k, frame)
                store.trained(last, seq)
                store.covered(seq)
                store.commit()
                last, seq = keys, seq + MAX_BATCH_MSGS
            secs = time.perf_counter() - t0
    finally:
        store.close()
    return n * len(frame) / secs / 1e6


def disk_mb_s(record_bytes: int, d: str, n: int) -> float:
    """Raw synced writes: ``n`` records of ``record_bytes`` appended to one file, an fdatasync every
    MAX_BATCH_MSGS. Timed on the second pass, which overwrites the first's pages."""
    buf, path = os.urandom(record_bytes), os.path.join(d, "disk-check")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(2):
            os.sync()
            os.lseek(fd, 0, os.SEEK_SET)
            t0 = time.perf_counter()
            for i in range(n):
                os.write(fd, buf)
                if i % MAX_BATCH_MSGS == MAX_BATCH_MSGS - 1:
                    os.fdatasync(fd)
            os.fdatasync(fd)
            secs = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return n * record_bytes / secs / 1e6


def store_vs_disk(frame: bytes, work: str, mb: float, repeats: int) -> dict:
    n = max(min(int(mb * 1e6 / len(frame)), MAX_RECORDS) // MAX_BATCH_MSGS, 1) * MAX_BATCH_MSGS
    stores, disks = [], []
    for _ in range(repeats):  # interleaved, so other load hits both alike
        with tempfile.TemporaryDirectory(dir=work) as d:
            stores.append(store_mb_s(frame, d, n))
            disks.append(disk_mb_s(len(frame), d, n))
    store_mb, disk_mb = statistics.median(stores), statistics.median(disks)
    return {"store_mb_s": round(store_mb, 1), "disk_mb_s": round(disk_mb, 1),
            "store_vs_disk": round(store_mb / disk_mb, 3), "records": n}


# ---- main ------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", choices=["main", "learner", "floor-server", "floor-learner"])
    ap.add_argument("--steps", type=int, help="paced learner steps per load (default: ~15 s worth, 10..300)")
    ap.add_argument("--learner-step-ms", type=float, help="skip measuring learner_step_s(): use this")
    ap.add_argument("--store-mb", type=float, default=200.0, help="MB per timed pass of the store / disk check")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(ROOT, ".cache", "bench-buffer"),
                    help="where run dirs and store files go: the disk a run uses, not a tmpfs")
    ap.add_argument("--config")
    ap.add_argument("--step-s", type=float)
    args = ap.parse_args()
    if args.role == "learner":
        return learner_role(args.config, args.steps, args.step_s)
    if args.role.startswith("floor-"):
        return (floor_server if args.role == "floor-server" else floor_learner)(json.loads(args.config))
    os.makedirs(args.dir, exist_ok=True)
    load_before = load_avg()[0]
    step_s = args.learner_step_ms / 1e3 if args.learner_step_ms else learner_step_s()
    steps = args.steps or max(10, min(300, round(15 / step_s)))
    cpu, disk = {}, {}
    for name, kw in LOADS.items():
        templates = [make_group("bench", i, **kw) for i in range(TEMPLATES)]
        size = len(encode(templates[0]))
        cpu[name] = cpu_figures(paced_run(templates, steps, step_s, args.dir), steps, step_s, size)
        cpu[name]["floor"] = cpu_figures(floor_run(encode(templates[0]), steps, step_s), steps, step_s, size)
        disk[name] = store_vs_disk(encode(templates[0]), args.dir, args.store_mb, args.repeats)
    _report(args, step_s, steps, cpu, disk, load_before)


def _report(args, step_s: float, steps: int, cpu: dict, disk: dict, load_before: float) -> None:
    per_step = C.Config().learner.groups_per_step
    print(f"learner step at the default job: {step_s * 1e3:.1f} ms ({per_step} groups; "
          f"{'measured' if not args.learner_step_ms else 'given'}); {steps} paced steps per load; "
          f"load {load_before:.2f} -> {load_avg()[0]:.2f}")
    rows = []
    for name in LOADS:
        c, d, u = cpu[name], disk[name], cpu[name]["cpu_us_per_group"]
        rows.append([name, c["group_bytes"], round(u["actor"]), round(u["server"]), round(u["learner"]),
                     round(u["total"]), c["cpu_ms_per_step"], c["cpu_frac_of_step"], c["floor"]["cpu_ms_per_step"],
                     round(d["store_mb_s"]),
                     round(d["disk_mb_s"]), d["store_vs_disk"]])
    print(format_table(["load", "bytes", "actor us", "server us", "learner us", "us/group", "ms/step",
                        "of step", "floor ms", "store MB/s", "disk MB/s", "store/disk"], rows))
    d = disk["default"]
    headroom = d["store_mb_s"] * 1e6 / cpu["default"]["group_bytes"] / (per_step / step_s)
    print(f"store headroom at the default job: {headroom:.0f}x the groups the learner consumes")
    print(json.dumps({
        "bench": "buffer", "cpu_frac_of_step": cpu["default"]["cpu_frac_of_step"],
        "floor_frac_of_step": cpu["default"]["floor"]["cpu_frac_of_step"],
        "store_headroom": round(headroom, 1),
        "store_vs_disk": disk["long"]["store_vs_disk"], "learner_step_ms": round(step_s * 1e3, 2),
        "learner_step_measured": not args.learner_step_ms, "groups_per_step": per_step, "steps": steps,
        "cpu": cpu, "disk": disk, "repeats": args.repeats,
        "load_before": round(load_before, 2), "load_after": round(load_avg()[0], 2),
    }))


if __name__ == "__main__":
    main()
