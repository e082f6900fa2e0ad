"""The driver's side of the mismatch corrections (tis, mis, icepop): which log-probs go where, each token's
importance weight and which tokens leave the loss, against values computed by hand.

The batch: sequence A, two tokens, the engine's log-probs [-1, -2] and the trainer's [-0.5, -2] (log-ratios
0.5 and 0: rho = e^0.5 = 1.6487 and 1); sequence B, one token, the engine's -0.5 and the trainer's -2 (log-ratio
-1.5: rho = e^-1.5 = 0.2231)."""
import math

import pytest

from orchestrator.iteration.mismatch import MismatchCorrection, use_trainer_old_logprobs
from trainer.batch import TrainBatch, TrainSequence

E05, EM15 = math.exp(0.5), math.exp(-1.5)
TRAINER = [[-0.5, -2.0], [-2.0]]


def _batch(mask_a: list[float] | None = None) -> TrainBatch:
    return TrainBatch([TrainSequence([1], [2, 3], old_logprobs=[-1.0, -2.0], loss_mask=mask_a or []),
                       TrainSequence([1], [4], old_logprobs=[-0.5])])


def _correct(kind: str, batch: TrainBatch | None = None, **knobs) -> tuple[TrainBatch, dict]:
    batch = batch or _batch()
    return batch, use_trainer_old_logprobs(batch, TRAINER, MismatchCorrection(kind, **knobs))


def test_engine_logprobs_move_aside_and_the_trainers_become_old():
    batch, m = _correct("tis")
    assert [s.rollout_logprobs for s in batch.sequences] == [[-1.0, -2.0], [-0.5]]
    assert [s.old_logprobs for s in batch.sequences] == TRAINER
    assert batch.old_recomputed
    assert m["logprob_gap"] == pytest.approx((0.5 + 0 + 1.5) / 3)
    assert m["is_ratio_max"] == pytest.approx(E05) and m["is_ratio_min"] == pytest.approx(EM15)


def test_tis_truncates_each_tokens_ratio_at_the_cap():
    batch, m = _correct("tis", tis_cap=2.0)  # no ratio above 2
    assert [s.is_weights for s in batch.sequences] == [[pytest.approx(E05), 1.0], [pytest.approx(EM15)]]
    assert m["is_weight_mean"] == pytest.approx((E05 + 1 + EM15) / 3) and m["is_truncated_frac"] == 0.0
    batch, m = _correct("tis", tis_cap=1.5)  # e^0.5 is truncated to 1.5
    assert [s.is_weights for s in batch.sequences] == [[1.5, 1.0], [pytest.approx(EM15)]]
    assert m["is_weight_mean"] == pytest.approx((1.5 + 1 + EM15) / 3)
    assert m["is_truncated_frac"] == pytest.approx(1 / 3)
    assert all(s.trained_mask == [1.0] * len(s.completion_ids) for s in batch.sequences)  # nothing left out


def test_mis_weighs_every_token_by_its_sequences_ratio_and_leaves_out_a_sequence_above_the_threshold():
    batch, m = _correct("mis", mis_threshold=2.0)  # A: rho = e^(0.5 + 0) = 1.65 <= 2; B: e^-1.5
    assert [s.is_weights for s in batch.sequences] == [[pytest.approx(E05)] * 2, [pytest.approx(EM15)]]
    assert m["is_masked_frac"] == 0.0 and m["is_masked_seq_frac"] == 0.0
    batch, m = _correct("mis", mis_threshold=1.5)  # A's 1.65 > 1.5: A leaves the loss, B stays
    a, b = batch.sequences
    assert a.trained_mask == [0.0, 0.0] and a.trained_tokens == 0 and a.is_weights == [0.0, 0.0]
    assert b.trained_mask == [1.0] and b.is_weights == [pytest.approx(EM15)]
    assert m["is_masked_frac"] == pytest.approx(2 / 3) and m["is_masked_seq_frac"] == pytest.approx(1 / 2)
    assert m["is_weight_mean"] == pytest.approx(EM15)  # over the kept tokens
    assert m["logprob_gap"] == pytest.approx(2 / 3)  # the left-out tokens still count in the gap check


def test_mis_takes_the_product_over_trained_tokens_only():
    """A multi-turn sequence's inserted tokens (loss mask 0) were not sampled: their ratio is no evidence."""
    batch, _ = _correct("mis", _batch(mask_a=[0.0, 1.0]), mis_threshold=1.5)  # A's trained token: ratio 1
    a = batch.sequences[0]
    assert a.trained_mask == [0.0, 1.0] and a.is_weights == [1.0, 1.0]


def test_icepop_keeps_tokens_inside_the_bounds_with_their_ratio_and_leaves_out_the_rest():
    batch, m = _correct("icepop", icepop_low=0.5, icepop_high=5.0)  # B's 0.22 < 0.5
    a, b = batch.sequences
    assert a.is_weights == [pytest.approx(E05), 1.0] and a.trained_mask == [1.0, 1.0]
    assert b.is_weights == [0.0] and b.trained_mask == [0.0]
    assert m["is_masked_frac"] == pytest.approx(1 / 3) and m["is_masked_seq_frac"] == pytest.approx(1 / 2)
    assert m["is_weight_mean"] == pytest.approx((E05 + 1) / 2)
    batch, _ = _correct("icepop", icepop_low=0.1, icepop_high=1.5)  # now A's first token (1.65) is out
    a, b = batch.sequences
    assert a.trained_mask == [0.0, 1.0] and a.is_weights == [0.0, 1.0] and b.trained_mask == [1.0]


def test_icepop_keeps_a_multi_turn_mask():
    batch, _ = _correct("icepop", _batch(mask_a=[0.0, 1.0]), icepop_low=0.5, icepop_high=1.5)
    assert batch.sequences[0].trained_mask == [0.0, 1.0]  # token 0 is out either way; token 1 (ratio 1) in


def test_lengths_must_match():
    with pytest.raises(ValueError, match="1 log-probs for a 2-token completion"):
        use_trainer_old_logprobs(_batch(), [[-0.5], [-2.0]], MismatchCorrection("tis"))
