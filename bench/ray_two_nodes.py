"""Two Ray nodes on one machine: the actors on one, the buffer and the learner on the other.

What a two-machine layout needs, checked without a second machine: ``ray.cluster_utils.Cluster``
starts a head node offering the custom resource ``node1`` and a second node offering ``node2``
(two raylets, as two hosts would have); ``ray.address`` joins that cluster, and the per-role custom
resources pin the roles (``ray.buffer_resources`` / ``ray.learner_resources`` = {node1 = 1},
``ray.actor_resources`` = {node2 = 1}). The roles then sit on different Ray nodes, so the launcher
binds the buffer on its node's IP (not loopback: CURVE keys are made here, as an operator would
with ``core.net.make_curve_keys``) and weights travel by ``weightsync.transport=filesystem`` over
the run directory. Prints where each role ran (Ray node ids) and the run's final steps and reward;
its last line is one JSON object with the same.

    python bench/ray_two_nodes.py [--steps 12] [--actors 2] [--model tiny|default]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import jobs  # noqa: E402
from core import config as C  # noqa: E402
from core import net  # noqa: E402
from tests.support.runs import TINY_RUN, lines  # noqa: E402


def curve_overrides() -> list[str]:
    """Server keys and a one-client allow-list: what a two-host run must be given."""
    spub, ssec = net.make_curve_keys()
    cpub, csec = net.make_curve_keys()
    return [f'net.curve_server_public="{spub}"', f'net.curve_server_secret="{ssec}"',
            f'net.curve_client_public="{cpub}"', f'net.curve_client_secret="{csec}"']


def start_cluster(actors: int) -> tuple[Cluster, dict[str, str]]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node1": 2},
                                                            "include_dashboard": False})
    node2 = cluster.add_node(num_cpus=actors, resources={"node2": actors})
    cluster.wait_for_nodes()
    return cluster, {cluster.head_node.node_id: "node1 (head)", node2.node_id: "node2"}


def config(address: str, steps: int, actors: int, run_dir: str, model: str) -> C.Config:
    size = TINY_RUN if model == "tiny" else ["run.eval_every=0", "monitor.live=off"]
    return C.load(None, size + [
        "run.launcher=ray", f'ray.address="{address}"', f"run.max_steps={steps}", "run.max_time_s=240",
        f"actor.num_actors={actors}", "learner.groups_per_step=4", "weightsync.transport=filesystem",
        "ray.buffer_resources={node1 = 1}", "ray.learner_resources={node1 = 1}",
        "ray.actor_resources={node2 = 1}", f'run.run_dir="{run_dir}"', *curve_overrides()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--model", choices=("tiny", "default"), default="tiny",
                    help="tiny: the tests' 32-wide model (fast, reward stays ~0); default: the default job's")
    args = ap.parse_args()
    t0 = time.time()
    cluster, names = start_cluster(args.actors)
    placed: dict[str, str] = {}
    try:
        run_dir = os.path.abspath(args.run_dir or f"runs/ray-two-nodes-{int(t0)}")
        cfg = config(cluster.address, args.steps, args.actors, run_dir, args.model)
        result = jobs.train(cfg, run_dir, on_ready=lambda rd, procs: placed.update(
            {r.name: r.handle.node_id for r in procs}))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    report(result, placed, names, time.time() - t0)


def report(result, placed: dict[str, str], names: dict[str, str], wall_s: float) -> None:
    """Where each role ran, what the buffer bound, the run's steps and final train reward."""
    with open(os.path.join(result.run_dir, "config.json"), "rb") as f:
        host = C.from_json(f.read()).net.host
    steps = lines(os.path.join(result.run_dir, "trained_keys.jsonl"))
    rewards = [r["reward/mean"] for r in lines(os.path.join(result.run_dir, "metrics.jsonl")) if "reward/mean" in r]
    reward = rewards[-1] if rewards else None
    for name, node in sorted(placed.items()):
        print(f"{name:8s} on {names.get(node, '?'):13s} {node}")
    print(f"buffer bound {host}; {len(steps)} steps, final train reward {reward}, "
          f"learner exit {result.returncodes.get('learner')}, {wall_s:.0f} s")
    print(json.dumps({"placed": {n: names.get(v, v) for n, v in placed.items()}, "host": host, "steps": len(steps),
                      "final_reward": reward, "learner_exit": result.returncodes.get("learner"),
                      "wall_s": round(wall_s, 1)}))

if __name__ == "__main__":
    main()
