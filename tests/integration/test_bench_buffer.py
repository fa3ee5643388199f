"""bench/buffer.py end to end on a short run, so that bench cannot rot: every part of it runs
(the paced path for both loads, the store and raw-disk checks) and its last line carries the
figures bench/README.md quotes. The learner step is given, not measured (that needs the base
model); no timing assertions."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_buffer_bench_runs_both_loads_and_ends_with_its_json_line(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "buffer.py"), "--steps", "3",
                          "--learner-step-ms", "20", "--store-mb", "4", "--repeats", "1", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bench"] == "buffer" and res["steps"] == 3 and not res["learner_step_measured"]
    for key in ("cpu_frac_of_step", "store_headroom", "store_vs_disk"):
        assert math.isfinite(res[key]) and res[key] > 0, key
    for load in ("default", "long"):
        cpu, disk = res["cpu"][load], res["disk"][load]
        assert set(cpu["cpu_us_per_group"]) == {"actor", "server", "learner", "total"}
        assert cpu["cpu_ms_per_step"] > 0 and disk["store_mb_s"] > 0 and disk["disk_mb_s"] > 0
    assert res["cpu"]["long"]["group_bytes"] > 50 * res["cpu"]["default"]["group_bytes"]
