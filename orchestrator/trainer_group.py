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
from orchestrator.config import ConfigError
from trainer.batch import TrainBatch
from trainer.config import TrainerSpec


class _Rank:
    """Thin actor shell: the Megatron worker is built in `setup`, after rank 0 has chosen the rendezvous port."""

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, spec: TrainerSpec, rank: int, world: int, addr: str, port: int) -> bool:
        from trainer.megatron.worker import MegatronWorker

        self.worker = MegatronWorker(spec, rank, world, addr, port)
        gc.collect()
        gc.freeze()  # the long-lived start-up heap (torch, Megatron): kept out of every later full collection
        return True

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def node(self) -> tuple[str, str]:
        """(IP address, Ray node id) of this rank's node."""
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

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


class TrainerGroup:
    def __init__(self, spec: TrainerSpec, timeout_s: float = 900, placement: Callable[[int], dict] | None = None):
        """`placement(i)`: Ray options placing rank i (orchestrator/placement.py); None: anywhere."""
        check_routing_replay(spec)
        self.spec, self.timeout = spec, timeout_s
        self.world = spec.trainer.parallel.world
        env = writer_process_env()
        device = spec.trainer.device
        if device == "cpu":
            # The phases take turns (the engines idle while the trainer steps): the ranks share this node's
            # cores.
            threads = str(max(1, len(os.sched_getaffinity(0)) // self.world))
            env |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        resources = {"num_gpus": 1} if device == "cuda" else {"num_cpus": 0}
        actor = ray.remote(**resources, runtime_env={"env_vars": env})(_Rank)
        self.ranks = [actor.options(**(placement(i) if placement else {})).remote() for i in range(self.world)]
        try:
            addr, port = self._get(self.ranks[0].address.remote())
            self._get([r.setup.remote(spec, i, self.world, addr, port) for i, r in enumerate(self.ranks)])
            self.node, self.node_id = self._get(self.ranks[0].node.remote())
        except BaseException:
            for r in self.ranks:  # ranks that did start would otherwise wait forever for the others
                ray.kill(r)
            raise

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

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> list[list[float]]:
        """Per sequence, the log-probs of its completion tokens under the batch's distribution: the policy's,
        or the frozen reference's (trainer.kl)."""
        merged: dict[int, list[float]] = {}
        for r in self._all("logprobs", batch, reference):
            if r:
                merged.update(r)
        return [merged[i] for i in range(len(batch.sequences))]

    def logits(self, token_lists: list[list[int]]):
        return next(r for r in self._all("logits", token_lists) if r is not None)

    def publish(self, run: str, iteration: int, directory: str, shard_bytes: int, writer_threads: int = 2) -> Manifest:
        results = self._all("publish", directory, self.node, shard_bytes, writer_threads)
        records = [s for r in results for s in r["shards"]]
        aux = sorted({name for r in results for name in r["aux_files"]})
        manifest = Manifest(run=run, iteration=iteration, directory=directory, shards=records, aux_files=aux,
                            tp_size=self.spec.trainer.parallel.tp)
        finalize_manifest(manifest)
        return manifest

    def reset_optimizer(self) -> None:
        self._all("reset_optimizer")

    def snapshot_reference(self) -> None:
        self._all("snapshot_reference")

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path)

    def parameter_digests(self) -> list[str]:
        return self._all("parameter_digest")

    def shutdown(self) -> None:
        for r in self.ranks:
            try:
                ray.get(r.call.remote("shutdown"), timeout=30)
                ray.get(r.exit.remote(), timeout=30)
            except ray.exceptions.RayActorError:  # it exits as asked, or was dead already
                continue
            except Exception:  # a rank that does not answer is killed
                pass
            ray.kill(r)
        self.ranks = []
