"""The learning rate of each RL iteration: linear warm-up over `warmup_iterations`, then `constant`, `linear`
or `cosine` decay from trainer.lr towards `min_lr`. A pure function of the iteration, so a resumed run gets
exactly the rates an uninterrupted one would.

The decay is transformers' (`get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup`, TRL's and
veRL's schedulers): the first iteration after the warm-up runs at trainer.lr and min_lr is reached one iteration
after the last, so the last iteration still updates (at min_lr + (lr - min_lr) / (iterations - warmup) for a
linear decay). The one deviation: transformers' warm-up starts at 0 (a wasted step); tide's iteration k of w
runs at lr x k / w, so iterations w and w + 1 both run at trainer.lr.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from ckpt_transfer.config import StrictModel


class LRSchedule(StrictModel):
    """The YAML `trainer.lr_schedule:` section."""

    warmup_iterations: int = Field(0, ge=0, description="RL iterations over which the learning rate rises "
                                   "linearly to trainer.lr (iteration k of w gets lr x k / w); 0: no warm-up.")
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After the warm-up: `constant` (trainer.lr), or a `linear` or `cosine` decay from "
        "trainer.lr towards min_lr, reached one iteration after the last (transformers' schedulers): the last "
        "iteration still updates.")
    min_lr: float = Field(0.0, ge=0, description="The learning rate a linear or cosine decay tends to (reached one "
                          "iteration after the run's last).")


def lr_at(lr: float, schedule: LRSchedule, iteration: int, iterations: int) -> float:
    """Learning rate of RL iteration `iteration` (1-based) of a run of `iterations`."""
    w = schedule.warmup_iterations
    if iteration <= w:
        return lr * iteration / w
    if schedule.decay == "constant":
        return lr
    progress = min(1.0, (iteration - w - 1) / max(iterations - w, 1))
    if schedule.decay == "linear":
        return schedule.min_lr + (lr - schedule.min_lr) * (1.0 - progress)
    return schedule.min_lr + (lr - schedule.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
