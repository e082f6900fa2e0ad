"""The learning rate of each RL iteration: linear warm-up over `warmup_iterations`, then `constant`, `linear`
or `cosine` decay to `min_lr` at the last iteration. A pure function of the iteration, so a resumed run gets
exactly the rates an uninterrupted one would."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LRSchedule(BaseModel):
    """The YAML `trainer.lr_schedule:` section."""

    model_config = ConfigDict(extra="forbid")

    warmup_iterations: int = Field(0, ge=0, description="RL iterations over which the learning rate rises "
                                   "linearly to trainer.lr (iteration k of w gets lr x k / w); 0: no warm-up.")
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After the warm-up: `constant` (trainer.lr), or a `linear` or `cosine` decay from "
        "trainer.lr to min_lr at the run's last iteration.")
    min_lr: float = Field(0.0, ge=0, description="The learning rate a linear or cosine decay ends at.")


def lr_at(lr: float, schedule: LRSchedule, iteration: int, iterations: int) -> float:
    """Learning rate of RL iteration `iteration` (1-based) of a run of `iterations`."""
    w = schedule.warmup_iterations
    if iteration <= w:
        return lr * iteration / w
    if schedule.decay == "constant":
        return lr
    progress = min(1.0, (iteration - w) / max(iterations - w, 1))
    if schedule.decay == "linear":
        return schedule.min_lr + (lr - schedule.min_lr) * (1.0 - progress)
    return schedule.min_lr + (lr - schedule.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
