"""A Ray cluster of several nodes on this machine: Ray's own multi-node test cluster (ray.cluster_utils.Cluster),
a head and N worker nodes, each a raylet of its own with its own resources and its own publish root
(TIDE_SHM_ROOT in its environment: ckpt_transfer.config.node_shm_root), so that a trainer spanning nodes
(placement.trainer_nodes) runs here on the real Ray, Megatron process groups and Mooncake transfer, its nodes'
shared memory kept apart as separate machines' would be.

    python scripts/sim_cluster.py --nodes 2 -- tide run configs/two_trainer_nodes.yaml
        starts the cluster, runs the command with `ray.address=<the cluster>` appended, stops the cluster and
        exits with the command's status;
    python scripts/sim_cluster.py --nodes 2 --serve
        prints one JSON line {"address", "roots": [the worker nodes' publish roots], "pid"} and holds the cluster
        until its stdin closes (the suite's fixture).

The head keeps the default publish root (the driver's, `publish.shm_root`); worker node j publishes under
`<--shm-base>/node<j>`. What a node's processes leave there is removed at exit, and only the processes this
script started are stopped (by Ray's node objects, by pid)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

NODE_SHM_ROOT_ENV = "TIDE_SHM_ROOT"  # ckpt_transfer.config.NODE_SHM_ROOT_ENV (not imported: no tide import here)


@contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int = 1, head_cpus: int = 2, shm_base: str | None = None,
                      gpus_per_node: int = 0) -> Iterator[dict]:
    """Start a head and `nodes` worker nodes; yields {"address": the GCS address, "roots": the worker nodes'
    publish roots}. Worker nodes offer `cpus_per_node` CPUs, `gpus_per_node` GPUs (declared, none real: for
    placement checks; nothing on CPU asks for one) and a `tide_sim_node` resource each."""
    from ray.cluster_utils import Cluster

    base = Path(shm_base or f"/dev/shm/tide-sim-{os.getpid()}")
    roots = [str(base / f"node{j}") for j in range(nodes)]
    # No idle workers started ahead of the actors: on 2 cores every raylet's prestarted workers would compete
    system = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": head_cpus, "include_dashboard": False, "_system_config": system})
    try:
        for root in roots:
            cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node, resources={"tide_sim_node": 1},
                             env_vars={NODE_SHM_ROOT_ENV: root})
        yield {"address": cluster.address, "roots": roots}
    finally:
        cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="worker nodes beside the head")
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--head-cpus", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=0, help="GPUs each worker node declares (none real)")
    ap.add_argument("--shm-base", default=None, help="where worker nodes' publish roots go (default "
                    "/dev/shm/tide-sim-<pid>)")
    ap.add_argument("--serve", action="store_true", help="print the address and hold the cluster until stdin closes")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run on the cluster")
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not a.serve and not command:
        ap.error("give a command after --, or --serve")
    with simulated_cluster(a.nodes, a.cpus_per_node, a.head_cpus, a.shm_base, a.gpus_per_node) as cluster:
        if a.serve:
            print(json.dumps({**cluster, "pid": os.getpid()}), flush=True)
            sys.stdin.read()
            return 0
        return subprocess.call([*command, f"ray.address={cluster['address']}"])


if __name__ == "__main__":
    sys.exit(main())
