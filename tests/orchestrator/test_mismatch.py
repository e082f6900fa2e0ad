"""The driver's side of truncated importance sampling: which log-probs go where, and the reported weights."""
import math

import pytest

from orchestrator.mismatch import tis_metrics, use_trainer_old_logprobs
from trainer.batch import TrainBatch, TrainSequence


def _batch() -> TrainBatch:
    return TrainBatch([TrainSequence([1], [2, 3], old_logprobs=[-1.0, -2.0]),
                       TrainSequence([1], [4], old_logprobs=[-0.5])])


def test_engine_logprobs_move_aside_and_the_trainers_become_old():
    batch = _batch()
    use_trainer_old_logprobs(batch, [[-0.5, -2.0], [-2.0]], cap=2.0)
    assert [s.rollout_logprobs for s in batch.sequences] == [[-1.0, -2.0], [-0.5]]
    assert [s.old_logprobs for s in batch.sequences] == [[-0.5, -2.0], [-2.0]]
    assert batch.tis_cap == 2.0
    # ratios e^0.5 = 1.649, 1, e^-1.5 = 0.223: none above the cap
    m = tis_metrics(batch)
    assert m["tis_weight_mean"] == pytest.approx((math.exp(0.5) + 1 + math.exp(-1.5)) / 3)
    assert m["tis_ratio_max"] == pytest.approx(math.exp(0.5))
    assert m["tis_clipped_frac"] == 0.0
    batch.tis_cap = 1.5  # now e^0.5 is truncated to 1.5
    m = tis_metrics(batch)
    assert m["tis_weight_mean"] == pytest.approx((1.5 + 1 + math.exp(-1.5)) / 3)
    assert m["tis_clipped_frac"] == pytest.approx(1 / 3)


def test_no_correction_no_metrics_and_lengths_must_match():
    assert tis_metrics(_batch()) == {}
    with pytest.raises(ValueError, match="1 log-probs for a 2-token completion"):
        use_trainer_old_logprobs(_batch(), [[-0.5], [-2.0]], cap=2.0)
