"""A trainer spanning two nodes (placement.trainer_nodes 2) on a simulated Ray cluster (scripts/sim_cluster.py:
Ray's own multi-node test cluster, a raylet per node, each node with its own publish root): each node publishes
what its ranks own, the engine's node pulls every tensor from the node holding it, and the run learns exactly as
its one-node twin on the session's cluster. A node agent killed mid-run fails the sync by name, and the restarted
run still ends as the twin."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.run_helpers import ROOT, TIDE, run_here, tide

pytestmark = pytest.mark.slow

# what the layout may change (where bytes went, and how fast), and the count of restarts a fault took
NOT_LEARNING = ("transfer_", "publish_bytes", "restarts")


@pytest.fixture(scope="module")
def sim_cluster():
    """A head and two worker nodes on this machine (two GPUs declared on each, none real: nothing on CPU asks for
    one); yields {"address", "roots": the worker nodes' publish roots}."""
    proc = subprocess.Popen([sys.executable, "scripts/sim_cluster.py", "--nodes", "2", "--gpus-per-node", "2",
                             "--serve"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "scripts/sim_cluster.py exited before serving"
        yield json.loads(line)
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def _config(tmp: Path, address: str, name: str, **parallel) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "two_trainer_nodes.yaml").read_text())
    tag = f"{os.getpid()}-{name}"
    cfg.update(name="two_trainer_nodes", iterations=2, save_every=1, ray={"address": address})
    cfg["trainer"]["warmup_sft_steps"] = 4
    cfg["trainer"]["parallel"] = {"tp": 1, "pp": 2, "ep": 1, **parallel}
    cfg["publish"]["shm_root"] = f"/dev/shm/tide-test-{tag}"
    cfg["transfer"].update(rollout_shm_root=f"/dev/shm/tide-test-rollout-{tag}",
                           registry_name=f"tide_test_registry_{tag}")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class ShardWatch:
    """Polls publish roots while a run goes on, recording each root's shard files per iteration directory."""

    def __init__(self, roots: list[str]) -> None:
        self.roots, self.seen = roots, {root: {} for root in roots}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            for root in self.roots:
                for shard in Path(root).glob("*/*/*.safetensors"):
                    self.seen[root].setdefault(shard.parent.name, set()).add(shard.name)

    def stop(self) -> dict[str, dict[str, set[str]]]:
        self._stop.set()
        self._thread.join()
        return self.seen


def _learning(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_LEARNING)} for r in rows]


def _assert_learns_as(run_dir: Path, twin: Path) -> None:
    assert _learning(run_dir) == _learning(twin)
    assert (run_dir / "samples.jsonl").read_text() == (twin / "samples.jsonl").read_text()
    digests = [json.loads((d / "final.json").read_text())["parameter_digests"] for d in (run_dir, twin)]
    assert digests[0] == digests[1]
    # the weights the engines served last (RUN_DIR/hf, exported from an engine node's whole copy): bit for bit
    # the one-node publish
    served = [_tensors(d / "hf") for d in (run_dir, twin)]
    assert served[0].keys() == served[1].keys() and len(served[0]) > 10
    assert all(torch.equal(served[0][name], served[1][name]) for name in served[0])


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {name: t for f in sorted(directory.glob("*.safetensors")) for name, t in load_file(f).items()}


def _twin(tmp: Path, address: str, pools, name: str, **parallel) -> Path:
    """The same run with every rank on one node, on the session's (one-node) cluster, in this process on its
    pooled ranks and engines."""
    run_dir = tmp / f"{name}-one-node"
    return run_here(pools, _config(tmp, address, name, **parallel), "placement.trainer_nodes=1", run_dir=run_dir)


def _check_parts(seen: dict[str, dict[str, set[str]]], stage_tag: str, restarted: bool = False) -> None:
    """Every iteration's shards came from two nodes, by the ranks' part (`stage_tag` + node index in their
    names), and no node ever held all of an iteration's. `restarted`: a run restarted by a fault may place its
    trainer on other nodes and publish its first iteration again there: more than two roots may then hold it."""
    iterations = {it for by_it in seen.values() for it in by_it}
    assert len(iterations) >= 3, seen  # the warm start's publish and the run's
    for it in iterations:
        held = {root: by_it[it] for root, by_it in seen.items() if by_it.get(it)}
        every = set().union(*held.values())
        assert len(held) >= 2 if restarted else len(held) == 2, (it, held)
        for files in held.values():
            assert files != every
            assert len({f.split(stage_tag)[1][:2] for f in files}) == 1, files  # one part per node
        assert {f.split(stage_tag)[1][:2] for f in every} == {"00", "01"}


def test_pipeline_stages_on_two_nodes_publish_apart_and_learn_as_one_node(sim_cluster, address, tmp_path,
                                                                          worker_pools):
    run_dir = tmp_path / "two-nodes"
    cfg = _config(tmp_path, sim_cluster["address"], "pp2")
    head_root = yaml.safe_load(cfg.read_text())["publish"]["shm_root"]
    watch = ShardWatch([head_root, *sim_cluster["roots"]])
    proc = tide("run", cfg, "--run-dir", run_dir)
    seen = watch.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_parts(seen, "-pp")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # both nodes published, about half each (stage 0 holds the embeddings, 1 the head)
        a, b = m["publish_bytes_node0"], m["publish_bytes_node1"]
        assert a > 0 and b > 0 and 0.3 < a / (a + b) < 0.7, m
    for root in [head_root, *sim_cluster["roots"]]:  # nothing left in any node's shared memory
        assert not Path(root).exists() or not any(Path(root).iterdir()), root
    _assert_learns_as(run_dir, _twin(tmp_path, address, worker_pools, "pp2"))
    # `tide export` rebuilds the served weights from the two-node run's checkpoint (no Ray, no node)
    exported = tide("export", run_dir, tmp_path / "exported", timeout=300)
    assert exported.returncode == 0, exported.stderr[-4000:]
    served, rebuilt = _tensors(run_dir / "hf"), _tensors(tmp_path / "exported")
    assert served.keys() == rebuilt.keys() and all(torch.equal(served[k], rebuilt[k]) for k in served)


def _agent_pid(root: str) -> int:
    """The pid of the node agent serving publish root `root` (its Ray worker process's environment names it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline.startswith(b"ray::_RayNodeAgent") and f"TIDE_SHM_ROOT={root}".encode() in environ:
            return int(entry.name)
    raise LookupError(f"no node agent serves {root}")


# Slower pulls for the kill below: reads of 4 KiB, one at a time, polled every 2 ms (~0.4 s for the ~0.8 MB
# checkpoint), so that a pull is seen in progress; nothing the run learns depends on them
SLOW_PULL = ["transfer.mooncake.bucket_bytes=4096", "transfer.mooncake.concurrency=1",
             "transfer.mooncake.poll_interval_s=0.002"]


def test_data_parallel_replicas_split_the_publish_and_a_node_agent_killed_mid_pull_restarts_the_run(
        sim_cluster, address, tmp_path, worker_pools):
    """A data-parallel replica per node, each writing half of the checkpoint. While the engine's node pulls
    iteration 2, the agent serving the shard it is pulling (a worker node's) is SIGKILLed: the pull fails naming
    that node and shard, nothing of iteration 2 is loaded (no manifest on the engine's node), `--max-restarts`
    restarts the run from its newest checkpoint, and it ends exactly as the uninterrupted one-node twin."""
    run_dir = tmp_path / "two-nodes"
    cfg = _config(tmp_path, sim_cluster["address"], "dp2", pp=1, dp=2)
    loaded = yaml.safe_load(cfg.read_text())
    head_root, sink_root = loaded["publish"]["shm_root"], Path(loaded["transfer"]["rollout_shm_root"]) / "rollout0"
    watch = ShardWatch([head_root, *sim_cluster["roots"]])
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([*TIDE, "run", str(cfg), "--run-dir", str(run_dir), "--max-restarts", "1",
                                 "--restart-backoff", "0", *SLOW_PULL], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=stderr)
    deadline, killed = time.monotonic() + 600, None
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        for partial in sink_root.glob("*/0000002/*.safetensors.partial"):
            shard = partial.name.removesuffix(".partial")
            holder = [r for r in sim_cluster["roots"] if any(Path(r).glob(f"*/0000002/{shard}"))]
            if holder:  # the engine's node is pulling a worker node's shard: kill that node's agent
                os.kill(_agent_pid(holder[0]), 9)
                killed = (holder[0], shard)
                break
        time.sleep(0.002)
    assert killed is not None, "no pull of a worker node's shard of iteration 2 was seen in progress"
    assert proc.wait(timeout=900) == 0, (tmp_path / "stderr").read_text()[-4000:]
    seen = watch.stop()
    _check_parts(seen, "-dp", restarted=True)
    first_failure = (run_dir / "error.log").read_text().split("\n=====")[0]
    assert "TransferError" in first_failure or "PeerUnavailableError" in first_failure, first_failure[-3000:]
    assert "node 'trainer" in first_failure and killed[1] in first_failure, (killed, first_failure[-3000:])
    _assert_learns_as(run_dir, _twin(tmp_path, address, worker_pools, "dp2", pp=1, dp=2))


def seen_so_far(watch: ShardWatch) -> dict:
    return {root: sorted(by_it) for root, by_it in watch.seen.items()}


GPU_PLACEMENT = """
import json, sys, ray
from orchestrator.workers.placement import Placement
from rollout.config import RolloutConfig
from trainer.config import ParallelConfig, TrainerConfig
ray.init(address=sys.argv[1], namespace="placement-check")
trainer = TrainerConfig(device="cuda", backend="nccl", parallel=ParallelConfig(dp=2, pp=2))
p = Placement.reserve(trainer, RolloutConfig(), trainer_nodes=2)
# actors, as the ranks are: each holds its GPU while the others are placed (a task's GPU is free again once it ends)
@ray.remote
class Rank:
    def where(self):
        return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()
ranks = [Rank.options(num_gpus=1, num_cpus=0, **p.trainer_rank(i)).remote() for i in range(4)]
at = ray.get([r.where.remote() for r in ranks], timeout=120)
print(json.dumps({"at": at, "agents": len(p.agents(1, sorted({n for n, _ in at})).sources)}))
"""


def test_gpu_ranks_spread_a_node_per_bundle(sim_cluster):
    """On GPUs a trainer of 4 ranks over 2 nodes takes a bundle of 2 GPUs on each of two distinct nodes, ranks 0-1
    on one and 2-3 on the other, each its own GPU, and a node agent is placed on each."""
    proc = subprocess.run([sys.executable, "-c", GPU_PLACEMENT, sim_cluster["address"]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    nodes = [node for node, _ in out["at"]]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert all(len(gpus) == 1 for _, gpus in out["at"])
    assert len({(node, gpus[0]) for node, gpus in out["at"]}) == 4 and out["agents"] == 2
