"""What one vLLM engine holds: its weights (its tensor-parallel share), its KV cache, and what the concurrency and
lengths of a rollout phase ask of that cache. Pure arithmetic, no vLLM import; `tide plan` composes it with the
trainer's side (trainer/memory_plan.py). Formulas: docs/training.md, "Memory planner"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GiB = 2**30
# An engine's process without its weights and KV cache (Python, torch, vLLM's CPU engine, its activations at the
# quickstart's batch): the quickstart engine's VmHWM (1052 MB) less its 0.25 GiB KV cache and weights, measured on
# 2026-12-06 with `scripts/validate_plan.py --calibrate`.
CPU_ENGINE_BASELINE = 796 * 2**20
# On cuda: the CUDA context, CUDA graphs and the activations of a prefill beside weights and cache (vLLM's
# profiling run reserves these before it sizes the cache): an estimate, not measured here
CUDA_ENGINE_BASELINE = 3 * GiB


@dataclass(frozen=True)
class EngineMemory:
    """Bytes per engine process (per GPU of it on cuda). `kv_cache`: what the engine allocates (rollout.kv_cache_gb,
    or on cuda what gpu_memory_utilization leaves); `kv_needed`: the concurrency times the longest sequence."""

    baseline: int
    weights: int
    kv_cache: int
    kv_needed: int
    concurrency: int
    kv_bytes_per_token: int
    lora: int = 0  # trainer.lora sync adapter: the adapter slots vLLM allocates beside the base

    @property
    def total(self) -> int:
        return self.baseline + self.weights + self.lora + self.kv_cache

    @property
    def sequences_cached(self) -> int:
        """How many longest sequences the allocated cache holds at once."""
        per_seq = self.kv_needed // max(self.concurrency, 1)
        return self.kv_cache // per_seq if per_seq else self.concurrency


def engine_memory(*, parameters: int, kv_elements_per_token: int, dtype_bytes: int, tp: int, concurrency: int,
                  seq_tokens: int, kv_cache_bytes: int | None, device: Literal["cpu", "cuda"],
                  gpu_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                  lora_parameters: int = 0) -> EngineMemory:
    """One engine (per GPU of its `tp`): weights and KV split over tp (vLLM shards heads; with fewer KV heads
    than tp each rank keeps a copy, which this ignores). The cache vLLM allocates: `kv_cache_bytes`
    (rollout.kv_cache_gb; on cpu 0.25 GiB when unset) or, on cuda, gpu_memory_utilization of the GPU less weights,
    adapter slots and the engine's own overhead (vLLM's own sizing). `lora_parameters`: the parameters of the
    adapter slots vLLM allocates (every slot at its max_lora_rank, on the targeted projections), in the model's
    dtype and split over tp."""
    weights = math.ceil(parameters * dtype_bytes / tp)
    lora = math.ceil(lora_parameters * dtype_bytes / tp)
    per_token = math.ceil(kv_elements_per_token * dtype_bytes / tp)
    baseline = CPU_ENGINE_BASELINE if device == "cpu" else CUDA_ENGINE_BASELINE
    if kv_cache_bytes is None:
        if gpu_bytes is None:
            raise ValueError("an engine on cuda without rollout.kv_cache_gb needs the GPU's memory")
        kv_cache_bytes = max(int(gpu_bytes * gpu_memory_utilization) - weights - lora - baseline, 0)
    else:
        kv_cache_bytes = math.ceil(kv_cache_bytes / tp) if device == "cuda" else kv_cache_bytes
    return EngineMemory(baseline=baseline, weights=weights, lora=lora, kv_cache=kv_cache_bytes,
                        kv_needed=concurrency * seq_tokens * per_token, concurrency=concurrency,
                        kv_bytes_per_token=per_token)
