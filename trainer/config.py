"""The trainer's settings: the YAML `trainer:` section (validated here, where it is consumed) and the
`TrainerSpec` a Megatron rank is built from. Pydantic only: importing this module imports neither torch nor
Megatron, so the orchestrator's schema can compose it and Ray can ship it to the ranks."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ParallelConfig(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep


class TrainerConfig(_Strict):
    """The YAML `trainer:` section."""

    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["gloo", "nccl"] = "gloo"
    parallel: ParallelConfig = ParallelConfig()
    loss: Literal["kimi", "grpo", "ppo_clip"] = "kimi"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    kimi_tau: float = Field(0.1, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    length_penalty: float = Field(0.0, ge=0)  # weight of Kimi k1.5's length reward; 0 disables it
    micro_batch_size: int = Field(64, gt=0)
    updates_per_iteration: int = Field(1, ge=1)  # optimizer steps per iteration (consecutive mini-batches)
    warmup_sft_steps: int = Field(0, ge=0)
    warmup_sft_batch: int = Field(64, gt=0)
    warmup_sft_lr: float = Field(3e-3, gt=0)

    @model_validator(mode="after")
    def _backend_fits_device(self) -> "TrainerConfig":
        if self.device == "cpu" and self.backend != "gloo":
            raise ValueError("trainer.backend must be 'gloo' when trainer.device is 'cpu'")
        return self


class TrainerSpec(_Strict):
    """What a trainer rank is built from: the model directory, the `trainer:` section as validated, and the
    run-wide settings it shares with the rollout (seed, determinism, parameter dtype)."""

    hf_dir: str
    trainer: TrainerConfig = TrainerConfig()
    seed: int = 0
    deterministic: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
