"""orchestrator/run/launch.py, the part of the Slurm and KubeRay recipes that starts tide on a started cluster:
against a plain local Ray of one node with 8 (declared) GPUs, a layout asking for more nodes or GPUs than exist is
refused by name before `tide run` starts; one that fits passes. The launch scripts themselves: bash -n, and the
RayJob manifest's Kubernetes fields."""
from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.schema import load_config
from orchestrator.run.launch import NodeResources, check_layout, cluster_nodes, tide_run_argv, wait_for_nodes

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
CUDA = {"trainer.device": "cuda", "trainer.backend": "nccl", "rollout.device": "cuda", "rollout.kv_cache_gb": None,
        "transfer.enabled": True, "transfer.mooncake.local_host": "auto"}


def _cuda(**parallel_and_more):
    overrides = dict(CUDA)
    overrides.update({k.replace("__", "."): v for k, v in parallel_and_more.items()})
    return load_config(QUICKSTART, overrides)


@pytest.fixture(scope="module")
def one_node_of_8_gpus():
    """One node of 8 GPUs and one CPU, as `cluster_nodes` reads a live one (checked against the session's
    cluster below: one process joins one Ray cluster, the suite's)."""
    return [NodeResources("10.0.0.1 (0123abcd)", 8, 1)]


def test_a_live_cluster_reads_as_its_nodes_with_their_gpus_and_cpus(ray_cluster):
    [node] = cluster_nodes()  # the session's cluster: one node, 4 GPUs declared, 2 CPUs
    assert (node.gpus, node.cpus) == (4, 2) and "(" in node.name
    assert wait_for_nodes(1, timeout_s=5) == [node]


def test_two_trainer_nodes_on_one_node_are_refused_by_name(one_node_of_8_gpus):
    cfg = _cuda(**{"trainer__parallel__pp": 2, "placement__trainer_nodes": 2, "rollout__engines": 1})
    [problem] = check_layout(cfg, one_node_of_8_gpus)
    assert "need 2 node(s) with 1 GPU(s) each" in problem and "placement.trainer_nodes 2" in problem
    assert "the cluster has 1 such node(s) of 1" in problem and "8 GPU(s)" in problem


def test_engines_beyond_the_gpus_the_trainer_leaves_are_refused_by_name(one_node_of_8_gpus):
    cfg = _cuda(**{"trainer__parallel__tp": 2, "trainer__parallel__dp": 2, "rollout__engines": 3,
                   "rollout__tp": 2})
    [problem] = check_layout(cfg, one_node_of_8_gpus)  # 4 ranks leave 4 GPUs: 2 engines of 2, not 3
    assert "3 engine(s) of 2 GPU(s) each" in problem and "room for 2" in problem


def test_a_layout_that_fits_passes(one_node_of_8_gpus):
    cfg = _cuda(**{"trainer__parallel__tp": 2, "trainer__parallel__dp": 2, "rollout__engines": 2, "rollout__tp": 2})
    assert check_layout(cfg, one_node_of_8_gpus) == []


def test_colocated_engines_need_no_gpus_beyond_the_trainers(one_node_of_8_gpus):
    cfg = _cuda(**{"trainer__parallel__dp": 8, "rollout__engines": 8, "placement__mode": "colocated"})
    assert check_layout(cfg, one_node_of_8_gpus) == []
    disaggregated = _cuda(**{"trainer__parallel__dp": 8, "rollout__engines": 8})
    assert "room for 0" in check_layout(disaggregated, one_node_of_8_gpus)[0]


def test_waiting_for_nodes_that_never_join_fails_naming_how_many_did(ray_cluster):
    from orchestrator.run.launch import LayoutDoesNotFit

    with pytest.raises(LayoutDoesNotFit, match=r"1 of 3 Ray nodes joined within 0 s"):
        wait_for_nodes(3, timeout_s=0)


def test_the_trainer_takes_the_smallest_nodes_that_hold_its_ranks():
    # two trainer nodes of 4 ranks on the two 4-GPU nodes leave the 8-GPU node whole, to an engine of TP 8
    nodes = [NodeResources("big", 8, 8), NodeResources("a", 4, 8), NodeResources("b", 4, 8)]
    trainer = {"trainer__parallel__tp": 4, "trainer__parallel__pp": 2, "placement__trainer_nodes": 2,
               "rollout__tp": 8}
    assert check_layout(_cuda(**trainer, rollout__engines=1), nodes) == []
    assert "room for 1" in check_layout(_cuda(**trainer, rollout__engines=2), nodes)[0]


@pytest.mark.parametrize("name, nodes", [("qwen3-30b-a3b-2nodes.yaml", 3), ("mixtral-8x7b-gsm8k.yaml", 2)])
def test_the_cluster_examples_fit_the_nodes_their_comments_describe(name, nodes, tmp_path):
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    for split in ("train", "test"):  # the data files the configs name, as their comment's command writes them
        (tmp_path / "data" / "gsm8k" / f"{split}.jsonl").write_text('{"messages": [], "answer": "2"}\n')
    (tmp_path / name).write_text((ROOT / "configs" / "cluster" / name).read_text())
    cfg = load_config(tmp_path / name)
    cluster = [NodeResources(f"n{i}", 8, 64) for i in range(nodes)]
    assert check_layout(cfg, cluster) == []
    assert check_layout(cfg, cluster[:-1])  # one node fewer does not hold it


def test_tide_run_gets_the_address_as_an_override():
    argv = tide_run_argv(Path("c.yaml"), ["iterations=3"], "10.0.0.1:6379", "runs/x", 2)
    assert argv[1:] == ["-m", "orchestrator.run.cli", "run", "c.yaml", "iterations=3", "ray.address=10.0.0.1:6379",
                        "--run-dir", "runs/x", "--max-restarts", "2"]


def _sim_cluster():
    spec = importlib.util.spec_from_file_location("sim_cluster", ROOT / "scripts" / "sim_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.simulated_cluster(nodes=1)


def _launch(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.run.launch", str(QUICKSTART), *args,
                           "transfer.enabled=true", "--nodes", "2", "--check-only", f"ray.address={address}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_launcher_on_the_simulated_cluster():
    """The command the recipes run, as a process of its own, on scripts/sim_cluster.py's cluster of two nodes (a
    head and a worker), given its address as sim_cluster gives it (a ray.address override): a trainer on both
    nodes passes, one on three exits 2 naming the nodes."""
    with _sim_cluster() as cluster:
        fits = _launch(cluster["address"], "trainer.parallel.dp=2", "placement.trainer_nodes=2")
        short = _launch(cluster["address"], "trainer.parallel.dp=3", "placement.trainer_nodes=3")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "2 node(s) hold the layout" in fits.stderr
    assert short.returncode == 2, short.stderr[-2000:]
    assert "need 3 node(s) with 1 CPU each" in short.stderr and "the cluster has 2 such node(s) of 2" in short.stderr


def test_the_sbatch_script_parses():
    path = ROOT / "scripts" / "launch" / "slurm" / "tide.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert '"$RAY" start --head --block' in text and '"$RAY" start --block --address' in text
    assert "orchestrator.run.launch" in text and "trap stop_ray EXIT" in text


def test_the_rayjob_manifest_is_a_rayjob_with_gpu_groups_and_shared_memory():
    manifest = yaml.safe_load((ROOT / "configs" / "cluster" / "kuberay" / "rayjob.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    spec = manifest["spec"]
    entry = shlex.split(spec["entrypoint"])
    assert entry[:3] == ["python", "-m", "orchestrator.run.launch"] and "--nodes" in entry
    config = next(a for a in entry if a.endswith(".yaml"))
    assert config.startswith("/opt/tide/") and (ROOT / config.removeprefix("/opt/tide/")).is_file()
    cluster = spec["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    workers = sum(g["replicas"] for g in cluster["workerGroupSpecs"])
    assert int(entry[entry.index("--nodes") + 1]) == 1 + workers
    for group in groups:
        [container] = group["template"]["spec"]["containers"]
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"].endswith("Gi")
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 8
        assert group["rayStartParams"]["num-gpus"] == "8"
