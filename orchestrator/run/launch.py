"""Start `tide run` on a Ray cluster someone else started (Slurm's sbatch, KubeRay's RayJob, `ray start` by hand,
scripts/sim_cluster.py here): wait until the expected nodes have joined, check that the cluster has the nodes and
GPUs the config's layout reserves, then replace this process with `tide run CONFIG ray.address=ADDRESS`.

    python -m orchestrator.run.launch --address auto --nodes 3 CONFIG [key.path=value ...] [--run-dir DIR]
    python scripts/sim_cluster.py --nodes 2 -- python -m orchestrator.run.launch CONFIG --nodes 3
        (the simulated cluster here: it appends ray.address=<its address>, which the launcher connects to)

The check mirrors orchestrator/workers/placement.py's reservations, on the cluster's total resources: a trainer on
placement.trainer_nodes > 1 nodes takes world / trainer_nodes GPUs on each of that many distinct nodes (a CPU on
cpu), a one-node trainer its world's GPUs on one node; then each engine rollout.tp GPUs on one node, from what the
trainer left. A layout that cannot be placed fails here, in seconds and by name (the nodes, the GPUs per node), not
after placement's 600 s wait or as a hang (the most common multi-node complaint of RL trainers' users: prime-rl
#941, #1412; slime #1487)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.schema import ConfigError, TideConfig, load_config, parse_overrides

JOIN_POLL_S = 2.0


@dataclass(frozen=True)
class NodeResources:
    name: str  # its address and the start of its Ray node id
    gpus: int
    cpus: int


class LayoutDoesNotFit(RuntimeError):
    pass


def cluster_nodes() -> list[NodeResources]:
    """The alive nodes of the Ray cluster this process is connected to, with their total GPUs and CPUs."""
    import ray

    return [NodeResources(name=f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})",
                          gpus=int(n["Resources"].get("GPU", 0)), cpus=int(n["Resources"].get("CPU", 0)))
            for n in ray.nodes() if n["Alive"]]


def wait_for_nodes(expected: int, timeout_s: float) -> list[NodeResources]:
    """Poll until `expected` nodes are alive; raise naming how many joined when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = cluster_nodes()
        if len(nodes) >= expected:
            return nodes
        if time.monotonic() >= deadline:
            raise LayoutDoesNotFit(f"{len(nodes)} of {expected} Ray nodes joined within {timeout_s:.0f} s: "
                                   f"{_listed(nodes)}; see the missing nodes' `ray start` logs")
        time.sleep(JOIN_POLL_S)


def check_layout(cfg: TideConfig, nodes: list[NodeResources]) -> list[str]:
    """What the cluster lacks for the config's trainer ranks and engines (empty: it fits). The trainer's nodes
    are chosen as placement would leave the most room: those with the fewest GPUs that hold a node's ranks."""
    t, r = cfg.trainer, cfg.rollout
    trainer_nodes, world = cfg.placement.trainer_nodes, t.parallel.world
    free = {n.name: n.gpus for n in nodes}
    problems = []
    if t.device == "cuda" or trainer_nodes > 1:
        per_node = world // trainer_nodes
        gpu = t.device == "cuda"
        need = per_node if gpu else 1
        fitting = sorted((n for n in nodes if (n.gpus if gpu else n.cpus) >= need), key=lambda n: n.gpus)
        if len(fitting) < trainer_nodes:
            unit = f"{per_node} GPU(s)" if gpu else "1 CPU"
            problems.append(f"the trainer's {world} ranks need {trainer_nodes} node(s) with {unit} each "
                            f"(placement.trainer_nodes {trainer_nodes}, trainer.parallel dp x tp x pp x ep = "
                            f"{world}); the cluster has {len(fitting)} such node(s) of {len(nodes)}: "
                            f"{_listed(nodes)}")
        elif gpu:
            for n in fitting[:trainer_nodes]:
                free[n.name] -= per_node
    shares = cfg.placement.mode == "colocated" and r.device == "cuda"  # engines on the ranks' GPUs: none more
    if r.device == "cuda" and not shares:
        room = sum(g // r.tp for g in free.values())
        if room < r.engines:
            problems.append(f"{r.engines} engine(s) of {r.tp} GPU(s) each (rollout.engines x rollout.tp) need "
                            f"{r.engines} node slot(s) of {r.tp} GPUs beside the trainer's; the cluster leaves "
                            f"room for {room}: free GPUs per node after the trainer {free}")
    return problems


def _listed(nodes: list[NodeResources]) -> str:
    return ", ".join(f"{n.name}: {n.gpus} GPU(s), {n.cpus} CPU(s)" for n in nodes) or "none"


def tide_run_argv(config: Path, overrides: list[str], address: str, run_dir: str | None,
                  max_restarts: int) -> list[str]:
    argv = [sys.executable, "-m", "orchestrator.run.cli", "run", str(config), *overrides, f"ray.address={address}"]
    if run_dir:
        argv += ["--run-dir", run_dir]
    if max_restarts:
        argv += ["--max-restarts", str(max_restarts)]
    return argv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.run.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("overrides", nargs="*", help="key.path=value settings, as `tide run` takes them")
    ap.add_argument("--address", default=None, help="the Ray cluster: host:port of its GCS, or `auto` on a node "
                    "of it (default: a ray.address=... override, else $RAY_ADDRESS, else auto)")
    ap.add_argument("--nodes", type=int, default=None, help="wait until this many nodes have joined")
    ap.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for them (default 300)")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--max-restarts", type=int, default=0)
    ap.add_argument("--check-only", action="store_true", help="check the cluster and exit")
    a = ap.parse_intermixed_args(argv)
    try:
        given = parse_overrides(a.overrides)
        address = a.address or given.pop("ray.address", None) or os.environ.get("RAY_ADDRESS") or "auto"
        overrides = [o for o in a.overrides if not o.startswith("ray.address=")]
        cfg = load_config(a.config, {**given, "ray.address": address})
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    import ray

    ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=False)
    try:
        nodes = wait_for_nodes(a.nodes, a.wait_s) if a.nodes else cluster_nodes()
        problems = check_layout(cfg, nodes)
    except LayoutDoesNotFit as e:
        problems = [str(e)]
    finally:
        ray.shutdown()
    for problem in problems:
        print(f"the Ray cluster at {address} cannot hold {a.config.name}: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(f"{len(nodes)} node(s) hold the layout: {_listed(nodes)}", file=sys.stderr)
    if a.check_only:
        return 0
    run = tide_run_argv(a.config, overrides, address, a.run_dir, a.max_restarts)
    sys.stdout.flush()
    os.execv(run[0], run)  # tide run gets this process's signals (Slurm's, Kubernetes') and its exit status
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
