"""RL losses over per-token log-probs. Pure torch; every function is checked against hand-computed values in
tests/trainer/test_losses.py.

Shapes: logp, old_logp, mask are [B, T] (T = completion positions, mask 1 on real completion tokens);
advantages and rewards are [B]. Losses return a token *sum*; the caller divides by the number of completion
tokens in the whole global batch, so micro-batching and data parallelism do not change the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossKind = Literal["kimi", "grpo", "ppo_clip"]


@dataclass(frozen=True)
class LossSpec:
    kind: LossKind = "kimi"
    kimi_tau: float = 0.1
    clip_eps: float = 0.2


def group_baseline_advantages(rewards: torch.Tensor, groups: torch.Tensor, normalize_std: bool) -> torch.Tensor:
    """r - mean(r over the samples of the same prompt); divided by the group's std (population) for GRPO."""
    adv = torch.empty_like(rewards)
    for g in torch.unique(groups):
        idx = groups == g
        r = rewards[idx]
        a = r - r.mean()
        if normalize_std:
            a = a / (r.std(unbiased=False) + 1e-6)
        adv[idx] = a
    return adv


def advantages(spec: LossSpec, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return group_baseline_advantages(rewards, groups, normalize_std=spec.kind == "grpo")


def kimi_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, tau: float) -> torch.Tensor:
    """Kimi k1.5 online mirror descent, per token: the policy gradient with the mean-reward baseline,
    -(r - r_mean) * log pi, plus tau/2 * (log pi - log pi_rollout)^2, which keeps the policy near the
    rollout policy (the squared log-ratio regulariser of the paper)."""
    return -adv[:, None] * logp + 0.5 * tau * (logp - old_logp) ** 2


def clipped_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    """PPO's clipped surrogate against the rollout policy (GRPO and ppo_clip differ only in advantages)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    return -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a)


def policy_loss_sum(spec: LossSpec, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                    adv: torch.Tensor) -> torch.Tensor:
    if spec.kind == "kimi":
        per_token = kimi_token_loss(logp, old_logp, adv, spec.kimi_tau)
    else:
        per_token = clipped_token_loss(logp, old_logp, adv, spec.clip_eps)
    return (per_token * mask).sum()


def length_reward(lengths: torch.Tensor, correct: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Kimi k1.5's length reward, per group: lam = 0.5 - (len - min_len) / (max_len - min_len); correct
    answers get lam, wrong ones min(0, lam). Zero where all samples of a group have the same length."""
    out = torch.zeros_like(lengths, dtype=torch.float32)
    for g in torch.unique(groups):
        idx = groups == g
        ln = lengths[idx].float()
        lo, hi = ln.min(), ln.max()
        if hi == lo:
            continue
        lam = 0.5 - (ln - lo) / (hi - lo)
        out[idx] = torch.where(correct[idx], lam, torch.clamp(lam, max=0.0))
    return out
