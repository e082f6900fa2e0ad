"""trainer/megatron/behaviour.py's pieces without ranks: the mini-batch cuts (issue 58 item 7) and where the
loglinear proximal policy takes computed values (item 6), by hand."""
import math

import pytest
import torch

from trainer.batch import LoglinearProximal, TrainSequence
from trainer.megatron.behaviour import ProximalStep, fresh_sequences, minibatch_bounds


def test_mini_batches_are_never_empty():
    assert minibatch_bounds(10, 4) == ([(0, 2), (2, 5), (5, 7), (7, 10)], 0)  # as before
    assert minibatch_bounds(4, 4) == ([(0, 1), (1, 2), (2, 3), (3, 4)], 0)
    # 3 samples for 4 mini-batches: the old cuts [0, 0, 1, 2, 3] left the first one empty
    assert minibatch_bounds(3, 4) == ([(0, 1), (1, 2), (2, 3)], 1)
    assert minibatch_bounds(1, 2) == ([(0, 1)], 1)
    assert minibatch_bounds(0, 2) == ([], 2)


def test_fresh_sequences_hold_a_trained_token_of_staleness_0():
    seqs = [TrainSequence([1, 2], [3, 4], versions=[1, 1]),  # stale
            TrainSequence([1, 2], [3, 4], versions=[1, 2]),  # in flight: its second token after the switch
            TrainSequence([1, 2], [3, 4], versions=[2, -1], loss_mask=[0.0, 0.0]),  # nothing trained
            TrainSequence([1, 2], [3, 4])]  # no versions: version 0
    assert fresh_sequences(seqs, [0, 1, 2, 3], LoglinearProximal(trained_by=2, tis_cap=2.0)) == [1]
    assert fresh_sequences(seqs, [3, 0], LoglinearProximal(trained_by=0, tis_cap=2.0)) == [3, 0]


def test_proximal_terms_place_computed_values_at_the_completion_positions():
    """A micro-batch row of a 3-token prompt and a 2-token completion (position t predicts token t + 1: the
    completion's fields at positions 2 and 3 of 5) and a placeholder row. Trained by version 1 with 2 steps per
    iteration, 1 step taken: the token of version 1 (staleness 0) takes the computed pi_prox, the token of version
    0 the interpolation alpha = 2 / 3."""
    seqs = [TrainSequence([5, 6, 7], [8, 9])]
    step = ProximalStep(LoglinearProximal(trained_by=1, tis_cap=2.0), steps_per_iteration=2, seqs=seqs,
                        computed={0: torch.tensor([-1.2, -7.0])})
    mb = {"index": [0, -1], "mask": torch.tensor([[0, 0, 1.0, 1.0, 0], [0.0] * 5]),
          "old": torch.tensor([[0, 0, -2.0, -2.5, 0], [0.0] * 5]),  # the engines' log-probs
          "versions": torch.tensor([[0, 0, 1.0, 0.0, 0], [0.0] * 5])}
    logp = torch.tensor([[-0.5, -0.5, -1.0, -1.5, -0.5], [-0.5] * 5])
    old, w, weight_sum, truncated = step.terms(mb, logp, steps_taken=1)
    # position 2: computed -1.2, weight e^(-1.2 + 2) = e^0.8 capped at 2; position 3: -2.5 + 2/3 (-1.5 + 2.5),
    # weight e^(2/3)
    assert old[0, 2:4].tolist() == pytest.approx([-1.2, -2.5 + 2 / 3])
    assert w[0, 2:4].tolist() == pytest.approx([2.0, math.exp(2 / 3)])
    assert weight_sum.item() == pytest.approx(2.0 + math.exp(2 / 3)) and truncated.item() == 1.0
    # before any step the current policy is pi_prox: the computed values are not read
    old, w, _, _ = step.terms(mb, logp, steps_taken=0)
    assert old[0, 2:4].tolist() == pytest.approx([-1.0, -1.5])
