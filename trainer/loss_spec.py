"""What a loss is made of (`LossSpec`), without torch: the config reads it, trainer/losses.py computes it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossKind = Literal["kimi", "kimi_token", "grpo"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass(frozen=True)
class LossSpec:
    kind: LossKind = "kimi"
    kimi_tau: float = 0.1
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    agg: LossAgg = "token_mean"  # grpo only
    adv_std_norm: bool = False
    adv_std_unbiased: bool = False
    adv_std_eps: float = 1e-6
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0

    @property
    def kl_agg(self) -> LossAgg:
        """How per-token regularisers (KL, entropy) are aggregated: per completion for `kimi`'s sequence-level
        objective, per token for `kimi_token`, like the policy loss for `grpo`."""
        return {"kimi": "seq_mean_token_sum", "kimi_token": "token_mean"}.get(self.kind, self.agg)
