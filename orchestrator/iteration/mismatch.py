"""Rollout-trainer mismatch correction (`rollout.mismatch_correction`): the engines sample from pi_rollout, which
on the same weights differs from the trainer's pi_old (bfloat16, other kernels). The trainer recomputes pi_old
before the update; with rho_t = pi_old(y_t) / pi_rollout(y_t) per completion token, the loss weighs each
token's policy-gradient term (trainer/losses.py) by

- `tis`, truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", fengyao.notion.site/off-policy-rl): w_t = min(rho_t, C);
- `mis`, sequence-level masked importance sampling (Liu, Li et al. 2025, "When Speed Kills Stability:
  Demystifying RL Collapse from the Training-Inference Mismatch", richardli.xyz/rl-collapse): the sequence's
  rho = prod_t rho_t on each of its tokens where rho <= C; a sequence with rho > C is left out (veRL's
  sequence-level IS with sequence-level rejection);
- `icepop` (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
  Model", arXiv:2510.18855): w_t = rho_t where low <= rho_t <= high; a token outside is left out.

"Left out" means out of the loss mask: such tokens add nothing to any loss term (policy gradient, KL, entropy)
nor to its normalisers (token and sequence counts), as veRL's rejection mask and slime's IcePop do. The weights
are computed here, on the driver, from the two sides' log-probs; the trainer applies them as given."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainer.batch import TrainBatch

Correction = Literal["tis", "mis", "icepop"]


@dataclass(frozen=True)
class MismatchCorrection:
    kind: Correction
    tis_cap: float = 2.0
    mis_threshold: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0


def use_trainer_old_logprobs(batch: TrainBatch, trainer_logprobs: list[list[float]],
                             correction: MismatchCorrection) -> dict[str, float]:
    """The engines' log-probs move to `rollout_logprobs`, `old_logprobs` become the trainer's, each sequence gets
    its `is_weights` and loses the tokens the correction leaves out from its loss mask. Returns the metrics, over
    every completion token the loss would otherwise train: `logprob_gap` (mean |log pi_old - log pi_rollout|,
    left-out tokens included), `is_weight_mean` (over the kept tokens), `is_ratio_max` / `is_ratio_min` (rho_t),
    `is_truncated_frac` (tis), `is_masked_frac` and `is_masked_seq_frac` (mis, icepop)."""
    for seq, ours in zip(batch.sequences, trainer_logprobs, strict=True):
        if len(ours) != len(seq.completion_ids):
            raise ValueError(f"the trainer returned {len(ours)} log-probs for a {len(seq.completion_ids)}-token "
                             f"completion")
        seq.rollout_logprobs, seq.old_logprobs = seq.old_logprobs, ours
    batch.old_recomputed = True
    log_ratios, weights, kept, seqs_out, seqs_in = [], [], [], 0, 0
    for seq in batch.sequences:
        mask = seq.trained_mask
        lr = [old - behaviour for old, behaviour in zip(seq.old_logprobs, seq.rollout_logprobs, strict=True)]
        w, keep = _weights(correction, lr, mask)
        seq.is_weights = w
        if not all(keep):
            seq.loss_mask = [m * k for m, k in zip(mask, keep)]
        trained = [i for i, m in enumerate(mask) if m]
        seqs_in += bool(trained)
        seqs_out += bool(trained) and not any(keep[i] for i in trained)
        log_ratios += [lr[i] for i in trained]
        weights += [w[i] for i in trained if keep[i]]
        kept += [keep[i] for i in trained]
    if not log_ratios:
        return {}
    ratios = [math.exp(min(x, 700.0)) for x in log_ratios]
    out = {"logprob_gap": sum(abs(x) for x in log_ratios) / len(log_ratios),
           "is_weight_mean": sum(weights) / len(weights) if weights else 0.0,
           "is_ratio_max": max(ratios), "is_ratio_min": min(ratios)}
    if correction.kind == "tis":
        out["is_truncated_frac"] = sum(r > correction.tis_cap for r in ratios) / len(ratios)
    else:
        out["is_masked_frac"] = kept.count(False) / len(kept)
        out["is_masked_seq_frac"] = seqs_out / max(seqs_in, 1)
    return out


def _weights(c: MismatchCorrection, log_ratios: list[float], mask: list[float]) -> tuple[list[float], list[bool]]:
    """Per completion token: the importance weight and whether the token stays in the loss."""
    if c.kind == "tis":
        return [math.exp(min(x, math.log(c.tis_cap))) for x in log_ratios], [True] * len(log_ratios)
    if c.kind == "mis":
        log_rho = sum(x for x, m in zip(log_ratios, mask) if m)  # the trained tokens' product, in logs
        if log_rho > math.log(c.mis_threshold):
            return [0.0] * len(log_ratios), [False] * len(log_ratios)
        return [math.exp(log_rho)] * len(log_ratios), [True] * len(log_ratios)
    if c.kind == "icepop":
        low, high = math.log(c.icepop_low), math.log(c.icepop_high)
        keep = [low <= x <= high for x in log_ratios]
        return [math.exp(x) if k else 0.0 for x, k in zip(log_ratios, keep)], keep
    raise ValueError(f"unknown mismatch correction {c.kind!r}")
