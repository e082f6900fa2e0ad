"""Rollout-trainer mismatch correction (`rollout.mismatch_correction: tis`): the engines sample from
pi_rollout, which on the same weights differs from the trainer's pi_old (bfloat16, other kernels). The trainer
recomputes pi_old before the update; its loss weighs each token by min(pi_old / pi_rollout, cap)
(trainer/losses.py: truncated importance sampling, Yao et al. 2025)."""
from __future__ import annotations

import math

from trainer.batch import TrainBatch


def use_trainer_old_logprobs(batch: TrainBatch, trainer_logprobs: list[list[float]], cap: float) -> None:
    """The engines' log-probs move to `rollout_logprobs`; `old_logprobs` become the trainer's."""
    for seq, ours in zip(batch.sequences, trainer_logprobs, strict=True):
        if len(ours) != len(seq.completion_ids):
            raise ValueError(f"the trainer returned {len(ours)} log-probs for a {len(seq.completion_ids)}-token "
                             f"completion")
        seq.rollout_logprobs, seq.old_logprobs = seq.old_logprobs, ours
    batch.tis_cap = cap


def tis_metrics(batch: TrainBatch) -> dict[str, float]:
    """Over every trained completion token (loss mask 1): the mean truncated weight the loss uses, the largest untruncated ratio
    pi_old / pi_rollout, and the fraction of tokens whose ratio the cap truncated."""
    cap = batch.tis_cap
    if cap is None:
        return {}
    ratios = [math.exp(old - behaviour) for s in batch.sequences
              for old, behaviour, m in zip(s.old_logprobs, s.rollout_logprobs, s.trained_mask, strict=True) if m]
    if not ratios:
        return {}
    return {"tis_weight_mean": sum(min(r, cap) for r in ratios) / len(ratios), "tis_ratio_max": max(ratios),
            "tis_clipped_frac": sum(r > cap for r in ratios) / len(ratios)}
