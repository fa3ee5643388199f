#!/usr/bin/env bash
# The single-GPU check (issue 17), at most ~5 minutes, everything written under $OUT:
#
#   bash bench/gpu_wheels.sh            # here, with package access: fills .wheels/ (git-ignored)
#   OUT=/some/dir bash bench/gpu_check.sh [--cpu-dry-run]
#
# (a) installs .wheels/ offline (pip --no-index --no-deps --find-links .wheels --target, then
#     PYTHONPATH): the GPU image brings torch/cupy/NCCL but not msgspec, pyzmq, crc32c;
# (b) python -m bench.gpu_check $OUT/gpu_check.log: the weight-path check (PASS only if
#     every step ran: cupy/NCCL, CUDA IPC between two processes, shm, fs);
# (c) a short real training run: learner and embedded engine on cuda, BF16 bodies with the FP32
#     islands (attention softmax, LM head), weightsync.transport=cuda_ipc, buffer.max_staleness=0;
#     prints ratio p50/p99/max at staleness 0 and the learner step time from its metrics.jsonl;
# (d) weight publish+apply time against one device-to-device copy of the same bytes (`ratio`,
#     from gpu_check's cuda-ipc step at model-like size, and from the run's own metrics).
#
# --cpu-dry-run runs the same stages on this CPU machine (device=cpu, transport shm, a tiny
# model) to exercise the install, the parsing and the printing; gpu_check then must FAIL (no
# CUDA) and the script checks that it does. Exit status: 0 only if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
[[ "${1:-}" == "--cpu-dry-run" ]] && MODE=cpu
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ $MODE == cpu && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
OUT=${OUT:-$(mktemp -d /tmp/driftrl-gpu-check.XXXXXX)}
mkdir -p "$OUT"
RUN_DIR=$(mktemp -d /tmp/driftrl-gpu-run.XXXXXX)  # many files: only a few are copied to $OUT
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu_check_script.log") 2>&1
echo "== bench/gpu_check.sh mode=$MODE python=$PYTHON OUT=$OUT $(date -u +%FT%TZ)"
failed=()

# ---- (a) wheels -------------------------------------------------------------------------------
if [[ -f .wheels/requirements.txt ]]; then
    SITE=$(mktemp -d /tmp/driftrl-site.XXXXXX)
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links .wheels \
            --target "$SITE" -r .wheels/requirements.txt; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        echo "OK wheels $(tr '\n' ' ' < .wheels/requirements.txt)-> $SITE"
    else
        echo "FAIL wheels: pip could not install .wheels/ for $("$PYTHON" -V 2>&1) (run bench/gpu_wheels.sh with this version)"
        failed+=(wheels)
    fi
else
    echo "-- no .wheels/: using what $PYTHON already has (bash bench/gpu_wheels.sh fills it)"
fi
if ! "$PYTHON" -c "import msgspec, zmq, crc32c, torch; print('OK imports torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; then
    echo "FAIL imports: the default job cannot start"; exit 1
fi

# ---- (b) the weight-path check ------------------------------------------------------------------
t0=$SECONDS
if [[ $MODE == gpu ]]; then
    timeout 150 "$PYTHON" -m bench.gpu_check "$OUT/gpu_check.log" --ipc-mb 1024 || failed+=(gpu_check)
else
    # no CUDA here: the check must refuse, exit 1, and say why
    timeout 150 "$PYTHON" -m bench.gpu_check "$OUT/gpu_check.log" --device cpu
    rc=$?
    if [[ $rc == 1 ]] && grep -q "^GPU_CHECK FAIL: needs a CUDA device" "$OUT/gpu_check.log"; then
        echo "OK gpu_check refused the CPU as it must (exit 1)"
    else
        echo "FAIL gpu_check on CPU exited $rc"; failed+=(gpu_check)
    fi
fi
echo "-- gpu_check took $((SECONDS - t0)) s"

# ---- (c) a short real training run ------------------------------------------------------------------
COMMON=(run.run_dir="$RUN_DIR" buffer.max_staleness=0 run.eval_every=0 monitor.live=off run.ckpt_every=0
        run.ckpt_every_s=0 learner.body_dtype=bfloat16 learner.fp32_attn_softmax=true learner.fp32_head=true
        actor.dtype=bfloat16 actor.fp32_attn_softmax=true)
# the device-side transport, unless gpu_check found CUDA IPC broken here (then shm, and it says so)
TRANSPORT=${TRANSPORT:-cuda_ipc}
if [[ $MODE == gpu && $TRANSPORT == cuda_ipc ]] && ! grep -q "^OK cuda-ipc" "$OUT/gpu_check.log" 2>/dev/null; then
    echo "-- gpu_check's cuda-ipc step did not pass: the run uses weightsync.transport=shm"; TRANSPORT=shm
fi
if [[ $MODE == gpu ]]; then
    RUN=(learner.device=cuda actor.device=cuda weightsync.transport=$TRANSPORT model.pretrain_steps=400
         run.max_steps=40 run.max_time_s=120)
else
    RUN=(learner.device=cpu actor.device=cpu weightsync.transport=shm model.hidden_size=32 model.num_layers=2
         model.num_heads=2 model.num_kv_heads=1 model.intermediate_size=64 model.pretrain_steps=40
         learner.groups_per_step=4 actor.group_size=4 actor.groups_per_batch=2 run.max_steps=3 run.max_time_s=60)
fi
t0=$SECONDS
timeout 200 "$PYTHON" run.py "${COMMON[@]}" "${RUN[@]}" > "$OUT/run.log" 2>&1
rc=$?
[[ $rc == 0 ]] || failed+=(run)
echo "-- training run took $((SECONDS - t0)) s (exit $rc); its output: $OUT/run.log"
cp "$RUN_DIR/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
for role in learner actor0; do cp "$RUN_DIR/logs/$role.log" "$OUT/$role.log" 2>/dev/null; done

# ---- (c)+(d) the figures ------------------------------------------------------------------------
"$PYTHON" - "$OUT" "$MODE" <<'EOF' | tee "$OUT/summary.txt"
import json, os, re, statistics, sys, time
import torch

out, mode = sys.argv[1], sys.argv[2]
recs = []
if os.path.exists(f"{out}/metrics.jsonl"):
    recs = [json.loads(l) for l in open(f"{out}/metrics.jsonl") if l.strip()]
learner = [r for r in recs if r.get("role") == "learner" and "ratio/p50" in r]
applies = [r["weightsync/apply_s"] for r in recs if r.get("role") == "actor" and r.get("weightsync/apply_s")]
def med(key, rows):
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")
ok = bool(learner) and all(r.get("staleness/max", 0) == 0 for r in learner)
print(f"{'OK' if ok else 'FAIL'} run steps={len(learner)} staleness_max={max((r.get('staleness/max', 0) for r in learner), default='n/a')}")
if learner:
    p50, p99 = med("ratio/p50", learner), med("ratio/p99", learner)
    rmax = max(r["ratio/max"] for r in learner)
    print(f"ratio at staleness 0 (median over steps): p50={p50:.6f} p99={p99:.6f} max(all steps)={rmax:.6f}")
    print(f"learner step_s: median={med('learner/step_s', learner):.4f} (steps after the first: "
          f"{med('learner/step_s', learner[1:]) if len(learner) > 1 else float('nan'):.4f})")
# (d) from the run: its publish + an actor's apply, against one device copy of the same bytes
pub, nbytes = med("weightsync/publish_s", learner[1:] or learner), med("weightsync/bytes", learner)
app = statistics.median(applies[1:] or applies) if applies else float("nan")
if nbytes == nbytes and nbytes > 0:
    dev = torch.device("cuda" if mode == "gpu" else "cpu")
    src = torch.empty(int(nbytes), dtype=torch.uint8, device=dev); dst = torch.empty_like(src); dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t0 = time.perf_counter(); dst.copy_(src)
        torch.cuda.synchronize() if dev.type == "cuda" else None
        best = min(best, time.perf_counter() - t0)
    print(f"run weight sync: bytes={int(nbytes)} publish_ms={pub * 1e3:.3f} apply_ms={app * 1e3:.3f} "
          f"copy_ms={best * 1e3:.3f} ratio={best / (pub + app):.3f} (a small model: latency-bound)")
# (d) from gpu_check's cuda-ipc step: model-sized bytes, apply in another process
log = f"{out}/gpu_check.log"
line = next((l for l in open(log) if l.startswith(("OK cuda-ipc", "FAIL cuda-ipc"))), None) if os.path.exists(log) else None
if line:
    got = dict(re.findall(r"(\w+)=([\d.]+)", line))
    print(f"gpu_check cuda-ipc: bytes={got.get('bytes')} publish_ms={got.get('publish_ms')} apply_ms={got.get('apply_ms')} "
          f"copy_ms={got.get('copy_ms')} ratio={got.get('ratio')} apply_ratio={got.get('apply_ratio')} (target ratio >= 0.8)")
else:
    print("gpu_check cuda-ipc: not run" + (" (expected on --cpu-dry-run)" if mode == "cpu" else ""))
if os.path.exists(log):
    print("gpu_check:", open(log).read().strip().splitlines()[-1])
sys.exit(0 if ok else 1)
EOF
[[ ${PIPESTATUS[0]} == 0 ]] || failed+=(summary)
rm -rf "$RUN_DIR"
echo "== done in ${SECONDS} s; failed stages: ${failed[*]:-none}; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[[ ${#failed[@]} == 0 ]]
