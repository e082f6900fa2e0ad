"""One Megatron-core trainer rank, as the orchestrator drives it: it runs one of these per rank as a Ray actor and
calls its public methods by name on all ranks at once (they take part in the same collectives). This module is
the door; the work lives beside it, one job a module:

  rank.py             the rank's state (process group, model, optimizer, frozen copies) and forward schedule
  micro_batches.py    sequences -> padded micro-batches, alike on every data-parallel rank
  logprobs.py         token log-probs and entropy from a vocabulary shard of the logits
  train_step.py       advantages, mini-batches, the loss's forward and backward, optimizer steps, statistics
  behaviour.py        the mini-batch cuts, the trainer-engine gap, the loglinear proximal policy
  routing_metrics.py  what routing replay changes, measured
  scoring.py          forward-only log-probs (policy, reference, behaviour snapshot) and logits
  publish.py          weights -> HF safetensors shards
  checkpoint.py       Megatron distributed checkpoints: save, load (resharded), model only, digest
  offload.py          parameters, gradients and optimizer state out of device memory between phases and back
  lora.py             LoRA adapters on the linears (trainer.lora): attach, merge, PEFT names

While offloaded, the calls that need the weights or optimizer state are refused by name (offload.resident)."""
from __future__ import annotations

from dataclasses import replace

import torch

from trainer.batch import TrainBatch
from trainer.megatron import checkpoint, offload, publish, scoring, train_step
from trainer.megatron.offload import resident
from trainer.megatron.rank import MegatronRank

# The rendezvous port of a one-rank process group (export, gpu_check): 0 lets the rank's own TCP store bind a port the
# OS picks; a port found free beforehand and released can be taken by another process before the store binds it
# (EADDRINUSE, seen once in the suite's gpu_check run)
SINGLE_RANK_PORT = 0


class MegatronWorker(MegatronRank):
    """Built by `MegatronWorker(spec, rank, world_size, master_addr, master_port)` (rank.py); besides
    snapshot_reference, snapshot_behaviour, reset_optimizer and shutdown, these are what the orchestrator calls."""

    @resident
    def train_step(self, batch: TrainBatch, mode: str = "rl", lr: float | None = None,
                   updates: int = 1, shuffle_seed: int | None = None, epochs: int = 1) -> dict[str, float]:
        """Optimizer steps on the batch and the iteration's train statistics (train_step.py)."""
        return train_step.train_step(self, batch, mode, lr, updates, shuffle_seed, epochs)

    @resident
    def logprobs(self, batch: TrainBatch, reference: bool = False,
                 behaviour: bool = False) -> dict[int, list[float]] | None:
        """Teacher-forced log-probs of every completion token, of the policy, the reference or the behaviour
        snapshot: {sequence index: [logp...]} on the reporting ranks, None elsewhere (scoring.py)."""
        return scoring.logprobs(self, batch, reference, behaviour)

    @resident
    def logits(self, token_lists: list[list[int]]) -> list[torch.Tensor] | None:
        """Full-vocabulary logits per sequence on the reporting ranks, None elsewhere (scoring.py)."""
        return scoring.logits(self, token_lists)

    @resident
    def publish(self, out_dir: str, node: str, shard_bytes: int, writer_threads: int = 2,
                adapter: bool = False) -> dict:
        """This rank's weights (or its LoRA adapter) as HF safetensors shards in `out_dir` (publish.py)."""
        return publish.publish(self, out_dir, node, shard_bytes, writer_threads, adapter)

    @resident
    def adapter_tensors(self) -> list:
        """This rank's LoRA adapter in PEFT's names, as ckpt_transfer.convert.HFTensor records: tensor-parallel
        shards marked as published ones are; none on data-parallel replicas past the first (lora.py)."""
        from trainer.megatron import lora

        return [replace(t, tensor=t.tensor.detach().cpu().clone())
                for t in lora.peft_tensors(self.module, self.layout())]

    @resident
    def adapter_parameters(self) -> int:
        """The parameters of the adapter records this rank writes (adapter_tensors' count, nothing copied): summed
        over the ranks, the whole adapter's."""
        from trainer.megatron import lora

        return sum(t.tensor.numel() for t in lora.peft_tensors(self.module, self.layout()))

    @resident
    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Model, optimizer (once it holds state), reference and RNG into `ckpt_dir` (checkpoint.py)."""
        checkpoint.save_checkpoint(self, ckpt_dir)

    @resident
    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Model, optimizer and RNG, resharded into this layout where megatron-core can (checkpoint.py)."""
        checkpoint.load_checkpoint(self, ckpt_dir)

    @resident
    def load_model(self, ckpt_dir: str) -> None:
        """The policy's parameters only, from a checkpoint of any layout (`tide export`; checkpoint.py)."""
        checkpoint.load_model(self, ckpt_dir)

    @resident
    def parameter_digest(self) -> str:
        """sha256 over this rank's parameters: equal digests mean equal weights."""
        return checkpoint.parameter_digest(self)

    def offload(self) -> dict[str, float]:
        """Parameters, optimizer state and gradients out of device memory until `onload` (offload.py)."""
        return offload.offload(self)

    def onload(self) -> dict[str, float]:
        """Everything `offload` released back, bit for bit (the gradients zeroed; offload.py)."""
        return offload.onload(self)
