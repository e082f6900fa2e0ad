"""bench_common.sft_steps, the TRL sides' warm start, ends where tide's does: on trainer.warmup_sft_stop_loss's rule
(orchestrator/iteration/warmup.py: the mean loss of the last 10 steps at most the bound, never before 10 steps), else
after all its steps."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.batch import TrainSequence

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


class Bigram(torch.nn.Module):
    def __init__(self, vocab: int = 8):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, ids):
        return SimpleNamespace(logits=self.table(ids))


@pytest.mark.parametrize("stop_loss, steps", [(None, 30), (1e9, 10), (1e-9, 30)])
def test_sft_steps_stops_by_tides_rule(monkeypatch, stop_loss, steps):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    sys.modules.pop("bench_common", None)
    from bench_common import sft_steps

    torch.manual_seed(0)
    sequences = [TrainSequence([1, 2], [3, 4, 5]) for _ in range(4)]  # every completion token trained
    losses = sft_steps(Bigram(), sequences, batch=2, steps=30, lr=1e-2, weight_decay=0.0, clip=1.0, pad_id=0,
                       stop_loss=stop_loss)
    assert len(losses) == steps and losses[-1] < losses[0]
