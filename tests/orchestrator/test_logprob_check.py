"""The log-prob checks' arithmetic (orchestrator/iteration/logprob_check.py), on a trainer that answers the engines' own
log-probs shifted by a known amount per sequence: the mean over the tokens the engines sampled, every sample
counted, inserted tokens left out."""
from types import SimpleNamespace

import pytest

from orchestrator.iteration.logprob_check import agent_logprob_gap, behaviour_gap
from rollout.samples import Sample, Samples
from trainer.batch import TokenDistribution


class ShiftedTrainer:
    """Each sequence's log-probs: the engines' (its old_logprobs) plus `shift[k]` for the k-th sequence scored."""

    def __init__(self, shift: list[float]):
        self.shift, self.asked = shift, []

    def logprobs(self, batch, behaviour=False):
        self.asked.append(behaviour)
        assert len(batch.sequences) == len(self.shift), "scored another number of sequences"
        return [[x + d for x in s.old_logprobs] for s, d in zip(batch.sequences, self.shift)]


def _trajectories() -> Samples:
    """Two tool trajectories an agent's task scores after the rollout (reward None): 2 sampled tokens, 1 inserted
    (log-prob 0.0), 1 sampled; and 1 sampled."""
    return Samples([Sample(0, "t", [1], [5, 6, 7, 8], [-0.5, -0.6, 0.0, -0.7], reward=None, loss_mask=[1, 1, 0, 1]),
                    Sample(1, "t", [1], [9], [-0.2], reward=None, loss_mask=[1])])


def test_the_agent_probe_reads_every_unscored_trajectory_over_its_sampled_tokens():
    trainer = ShiftedTrainer([0.1, 0.4])
    agent = SimpleNamespace(rollout=lambda *a, **k: SimpleNamespace(samples=_trajectories()))
    # (3 tokens x 0.1 + 1 x 0.4) / 4: the inserted token left out, the second trajectory counted though unscored
    assert agent_logprob_gap(trainer, agent, None, [], TokenDistribution(), 0) == pytest.approx(0.7 / 4)
    assert trainer.asked == [False]


def test_a_batch_drawn_ahead_is_read_every_share_th_sample_on_the_snapshot():
    trainer = ShiftedTrainer([0.3, 0.6])
    samples = Samples([*_trajectories().items, Sample(2, "t", [1], [4, 4], [-0.1, -0.1], reward=None)])
    # samples 0 and 2: (3 x 0.3 + 2 x 0.6) / 5
    assert behaviour_gap(trainer, samples, TokenDistribution(), share=2) == pytest.approx(2.1 / 5)
    assert trainer.asked == [True]
