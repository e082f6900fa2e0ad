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
