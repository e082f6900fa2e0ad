"""Messages into the trainer (no torch import: they cross Ray process boundaries as plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainSequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float] = field(default_factory=list)  # rollout policy, one per completion token
    reward: float = 0.0
    group: int = 0  # samples of the same prompt share a group (the baseline is per group)


@dataclass
class TrainBatch:
    sequences: list[TrainSequence]


@dataclass
class TrainerSpec:
    """What a trainer rank needs to build itself: a plain mirror of the YAML trainer section."""

    hf_dir: str
    device: str = "cpu"
    backend: str = "gloo"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    loss: str = "kimi"
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kimi_tau: float = 0.1
    clip_eps: float = 0.2
    micro_batch_size: int = 64
    seed: int = 0
    deterministic: bool = True
    dtype: str = "float32"
