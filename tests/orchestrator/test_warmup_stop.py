"""trainer.warmup_sft_stop_loss: the warm-up ends once the mean loss of its last 10 steps is at most the bound,
never before 10 steps, and never past warmup_sft_steps (orchestrator/iteration/warmup.py), on a trainer that only
counts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.iteration.warmup import WARMUP_STOP_WINDOW, reached, warm_start
from trainer.config import TrainerConfig


def test_reached_by_the_mean_of_the_last_ten_steps():
    assert WARMUP_STOP_WINDOW == 10
    assert not reached([0.0] * 9, 0.5)  # fewer than ten steps
    assert reached([0.0] * 10, 0.5)
    assert reached([9.0] + [0.5] * 10, 0.5)  # the eleventh step back does not count
    assert not reached([0.5] * 9 + [0.6], 0.5)  # mean 0.51
    assert not reached([0.0] * 20, None)


class CountingTrainer:
    def __init__(self, losses):
        self.losses, self.steps, self.calls = list(losses), 0, []

    def train_step(self, batch, mode, lr):
        self.steps += 1
        return {"loss": self.losses[self.steps - 1]}

    def reset_optimizer(self):
        self.calls.append("reset")

    def snapshot_reference(self):
        self.calls.append("reference")


def _task(n):
    pairs = [(SimpleNamespace(prompt_ids=[1, 2]), [3, 4])] * n
    return SimpleNamespace(task=object(), sft_pairs=lambda seed, k: pairs[:k])


# ten steps at loss 1.0, then 0.1: the mean of the last ten at step n (10 <= n <= 20) is (19 - 0.9 n) / 10, so
# 0.55 at step 15 and 0.46 at step 16; a bound of 1.0 is met at step 10 already, one of 0.05 never
@pytest.mark.parametrize("stop_loss, steps", [(None, 40), (0.5, 16), (1.0, 10), (0.05, 40)])
def test_the_warm_up_stops_at_the_loss_bound_or_its_step_budget(stop_loss, steps):
    losses = [1.0] * 10 + [0.1] * 30
    trainer = CountingTrainer(losses)
    cfg = TrainerConfig(warmup_sft_steps=40, warmup_sft_batch=2, warmup_sft_stop_loss=stop_loss)
    seen = []
    got = warm_start(trainer, _task(80), cfg, seed=0, on_step=lambda k, loss: seen.append(k))
    assert trainer.steps == steps and got == losses[:steps] and seen == list(range(1, steps + 1))
    assert trainer.calls == ["reset", "reference"]
