"""The trainer ranks as Ray actors, driven together (every call goes to all ranks: they share collectives)."""
from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from typing import Any

import ray

from ckpt_transfer.manifest import Manifest
from ckpt_transfer.writer import finalize_manifest, writer_process_env
from orchestrator.config.schema import ConfigError
from rollout.engine_proc import freeze_heap, gc_paused, pin_threads, share_gloo_device
from trainer.batch import TrainBatch
from trainer.config import TrainerSpec


class _Rank:
    """Thin actor shell: the Megatron worker is built in `setup`, after rank 0 has chosen the rendezvous port."""

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, spec: TrainerSpec, rank: int, world: int, addr: str, port: int, threads: int | None = None,
              cpus: tuple[int, ...] | None = None) -> bool:
        """`threads`: torch's intra-op threads (CPU ranks sharing a node's cores); `cpus`: the cores this process
        is bound to (placement.mode disaggregated on CPU), None: any."""
        with gc_paused():
            import torch

            from trainer.megatron.worker import MegatronWorker

        if getattr(self, "worker", None) is not None:
            raise RuntimeError("this rank holds a worker already: release() it first")
        if not hasattr(self, "_any_cpu"):
            self._any_cpu = os.sched_getaffinity(0)
        pin_threads(cpus or self._any_cpu)  # a pooled process may have been bound by its last group
        if threads:
            torch.set_num_threads(threads)
        share_gloo_device()
        with gc_paused():
            self.worker = MegatronWorker(spec, rank, world, addr, port)
        freeze_heap()  # the long-lived start-up heap (torch, Megatron): kept out of every later full collection
        return True

    def release(self) -> None:
        """Tear the worker down and keep the process, imports and all, for another group (RankPool)."""
        worker, self.worker = self.worker, None
        worker.shutdown()
        del worker
        gc.unfreeze()  # the worker's model and optimizer were frozen with the start-up heap
        gc.collect()

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> tuple[str, str]:
        """(IP address, Ray node id) of this rank's node."""
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this rank, by their ids on its node (none on CPU)."""
        return [str(g) for g in ray.get_gpu_ids()]

    def finalize_manifest(self, manifest: Manifest) -> Manifest:
        """Write the HF index and, last, the manifest into the publish directory on this rank's node (rank 0's,
        which holds the aux files); the manifest as written (its aux files gain the index)."""
        finalize_manifest(manifest)
        return manifest

    def exit(self) -> None:
        """End this process as Python ends, atexit handlers included: ray.kill skips them, and what libraries
        clean up there stays behind (wandb, imported by Megatron where installed, leaves two directories in /tmp)."""
        ray.actor.exit_actor()


def check_routing_replay(spec: TrainerSpec) -> None:
    """trainer.moe.routing_replay on a dense model is a configuration error, found before any rank starts."""
    if spec.trainer.moe.routing_replay == "none":
        return
    from transformers import AutoConfig

    from ckpt_transfer.convert import is_moe

    hf_config = AutoConfig.from_pretrained(spec.hf_dir)
    if not is_moe(hf_config):
        raise ConfigError(f"trainer.moe.routing_replay: {spec.trainer.moe.routing_replay} needs a mixture-of-experts "
                          f"model; {spec.hf_dir} ({hf_config.model_type}) has no experts: set it to none")


class RankPool:
    """Started trainer-rank processes kept between TrainerGroups on one CPU node. Most of a rank's start is
    importing torch, Megatron and transformers (7.5 of the 9-10 s a group took to start here); a TrainerGroup
    given the pool borrows started ranks and hands them back with their Megatron state torn down
    (MegatronWorker.shutdown), as Megatron's own tests initialise and destroy model parallelism in one process
    case after case. For a process that builds many groups (the test suite); a run builds one."""

    def __init__(self) -> None:
        self._actor = ray.remote(num_cpus=0, runtime_env={"env_vars": writer_process_env()})(_Rank)
        self._idle: list = []

    def take(self, n: int) -> list:
        while len(self._idle) < n:
            self._idle.append(self._actor.remote())
        taken, self._idle = self._idle[:n], self._idle[n:]
        return taken

    def give_back(self, ranks: list) -> None:
        self._idle.extend(ranks)

    def close(self) -> None:
        for r in self._idle:
            _end(r)
        self._idle = []


def _end(rank) -> None:
    """End a rank's process as Python ends (atexit handlers run: _Rank.exit), killing one that does not answer."""
    try:
        ray.get(rank.exit.remote(), timeout=30)
    except ray.exceptions.RayActorError:  # it exits as asked, or was dead already
        return
    except Exception:  # noqa: BLE001  (it does not answer: killed below)
        pass
    ray.kill(rank)


class TrainerGroup:
    def __init__(self, spec: TrainerSpec, timeout_s: float = 900, placement: Callable[[int], dict] | None = None,
                 pool: RankPool | None = None, cpus: tuple[int, ...] | None = None):
        """`placement(i)`: Ray options placing rank i (orchestrator/workers/placement.py); None: anywhere. `pool`:
        borrow started rank processes from it (CPU, no placement) and hand them back at shutdown. `cpus`: the
        host's cores the CPU ranks are bound to and share (placement.mode disaggregated); None: all of them, which
        the ranks have to themselves while the engines idle."""
        check_routing_replay(spec)
        self.spec, self.timeout = spec, timeout_s
        self.world = spec.trainer.parallel.world
        device = spec.trainer.device
        threads = None
        if device == "cpu":
            # Colocated, the phases take turns (the engines idle while the trainer steps): the ranks share this
            # node's cores; disaggregated, the cores they are given.
            threads = max(1, len(cpus or os.sched_getaffinity(0)) // self.world)
        if pool is not None and (device != "cpu" or placement is not None):
            raise ValueError("a RankPool serves CPU ranks placed anywhere on the driver's node")
        self._pool = pool
        if pool is not None:
            self.ranks = pool.take(self.world)
        else:
            env = writer_process_env()
            if threads:
                env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
            resources = {"num_gpus": 1} if device == "cuda" else {"num_cpus": 0}
            actor = ray.remote(**resources, runtime_env={"env_vars": env})(_Rank)
            self.ranks = [actor.options(**(placement(i) if placement else {})).remote() for i in range(self.world)]
        try:
            addr, port = self._get(self.ranks[0].address.remote())
            self._get([r.setup.remote(spec, i, self.world, addr, port, threads, cpus)
                       for i, r in enumerate(self.ranks)])
            self._locate(self._get([r.node.remote() for r in self.ranks]))
        except BaseException:
            for r in self.ranks:  # ranks that did start would otherwise wait forever for the others
                ray.kill(r)
            raise

    def _locate(self, rank_nodes: list[tuple[str, str]]) -> None:
        """Name the trainer's nodes, as its shards and their node agents will: by IP address on one node (where
        a rank runs is where its node agent serves), `trainer<j>-<ip>` in rank order across several (simulated
        nodes share an IP)."""
        ids = list(dict.fromkeys(node_id for _, node_id in rank_nodes))
        ip = {node_id: addr for addr, node_id in rank_nodes}
        names = {ids[0]: ip[ids[0]]} if len(ids) == 1 else {n: f"trainer{j}-{ip[n]}" for j, n in enumerate(ids)}
        self.rank_nodes = [names[node_id] for _, node_id in rank_nodes]  # per rank, its node's name
        self.nodes = [names[n] for n in ids]
        self.node_ids = ids  # Ray node ids, in the order of self.nodes
        self.node, self.node_id = self.nodes[0], ids[0]

    def gpu_ids(self) -> list[list[str]]:
        """Per rank, the GPU ids Ray gave it on its node."""
        return self._get([r.gpu_ids.remote() for r in self.ranks])

    def pids(self) -> list[int]:
        """The rank processes' pids, in rank order."""
        return self._get([r.pid.remote() for r in self.ranks])

    def _get(self, refs):
        return ray.get(refs, timeout=self.timeout)

    def _all(self, method: str, *args, **kwargs) -> list[Any]:
        args = tuple(ray.put(a) if isinstance(a, TrainBatch) else a for a in args)
        return self._get([r.call.remote(method, *args, **kwargs) for r in self.ranks])

    def _reported(self, results: list[Any]) -> Any:
        return next(r for r in results if r is not None and (not isinstance(r, dict) or r.get("reporting", True)))

    def train_step(self, batch: TrainBatch, mode: str = "rl", lr: float | None = None, updates: int = 1,
                   shuffle_seed: int | None = None, epochs: int = 1) -> dict:
        return self._reported(self._all("train_step", batch, mode, lr, updates, shuffle_seed, epochs))

    def logprobs(self, batch: TrainBatch, reference: bool = False, behaviour: bool = False) -> list[list[float]]:
        """Per sequence, the log-probs of its completion tokens under the batch's distribution: the policy's,
        the frozen reference's (trainer.kl) or the behaviour snapshot's (`snapshot_behaviour`)."""
        merged: dict[int, list[float]] = {}
        for r in self._all("logprobs", batch, reference, behaviour):
            if r:
                merged.update(r)
        return [merged[i] for i in range(len(batch.sequences))]

    def logits(self, token_lists: list[list[int]]):
        return next(r for r in self._all("logits", token_lists) if r is not None)

    def publish(self, run: str, iteration: int, directory: str | dict[str, str], shard_bytes: int,
                writer_threads: int = 2, adapter: bool = False) -> Manifest:
        """Every rank writes the HF tensors it owns into its node's directory (`directory`: one for all, or per
        node name); the manifest lists them all, each under its node, and is written beside rank 0's aux files
        (its `directory`). `adapter`: the LoRA adapter's tensors (PEFT names) instead of the model's."""
        dirs = directory if isinstance(directory, dict) else {n: directory for n in self.nodes}
        results = self._get([r.call.remote("publish", dirs[node], node, shard_bytes, writer_threads, adapter)
                             for r, node in zip(self.ranks, self.rank_nodes)])
        records = [s for r in results for s in r["shards"]]
        aux = sorted({name for r in results for name in r["aux_files"]})
        manifest = Manifest(run=run, iteration=iteration, directory=dirs[self.rank_nodes[0]], shards=records,
                            aux_files=aux, tp_size=self.spec.trainer.parallel.tp)
        return self._get(self.ranks[0].finalize_manifest.remote(manifest))

    def adapter(self) -> dict:
        """The LoRA adapter whole, in PEFT's names (trainer.lora): the ranks' shards, merged here (megabytes)."""
        from ckpt_transfer.peft_adapter import merge_records

        return merge_records(r for rank in self._all("adapter_tensors") for r in rank)

    def adapter_parameters(self) -> int:
        """The LoRA adapter's parameter count, from the ranks' own counts (no tensor leaves a rank)."""
        return sum(self._all("adapter_parameters"))

    def published_bytes(self, manifest: Manifest) -> dict[str, int]:
        """`publish_bytes_node<j>`: the bytes of `manifest` that the trainer's node j (self.nodes) wrote and
        serves, every node listed (0 where it wrote none)."""
        return {f"publish_bytes_node{j}": sum(s.nbytes for s in manifest.shards if s.node == node)
                for j, node in enumerate(self.nodes)}

    def reset_optimizer(self) -> None:
        self._all("reset_optimizer")

    def snapshot_reference(self) -> None:
        self._all("snapshot_reference")

    def snapshot_behaviour(self) -> None:
        """Keep the current policy for checking the batch the engines are sampling with it (max_staleness 1)."""
        self._all("snapshot_behaviour")

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path)

    def load_model(self, path: str) -> None:
        """The policy's parameters only (no optimizer state), from a checkpoint of any layout."""
        self._all("load_model", path)

    def parameter_digests(self) -> list[str]:
        return self._all("parameter_digest")

    def shutdown(self) -> None:
        if self._pool is not None:
            try:  # every rank at once
                self._get([r.release.remote() for r in self.ranks])
            except Exception:  # noqa: BLE001  (a rank that cannot be released is not handed back)
                for r in self.ranks:
                    ray.kill(r)
            else:
                self._pool.give_back(self.ranks)
            self.ranks = []
            return
        for r in self.ranks:
            try:
                ray.get(r.call.remote("shutdown"), timeout=30)
            except ray.exceptions.RayActorError:  # dead already
                continue
            except Exception:  # noqa: BLE001  (a rank that does not answer is killed)
                ray.kill(r)
                continue
            _end(r)
        self.ranks = []

    def offload(self) -> dict[str, float]:
        """Every rank's parameters, gradients and optimizer state out of device memory (the hybrid deployment,
        between publish and the next pass that needs them): the bytes of all ranks, the slowest rank's seconds."""
        results = self._all("offload")
        return {k: (max if k == "offload_s" else sum)(r[k] for r in results) for k in results[0]}

    def onload(self) -> dict[str, float]:
        """What `offload` released, back on every rank, bit for bit (offload's figures, for onload)."""
        results = self._all("onload")
        return {k: (max if k == "onload_s" else sum)(r[k] for r in results) for k in results[0]}
