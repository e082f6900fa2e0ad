"""Messages into the trainer (no torch import: they cross Ray process boundaries as plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TrainSequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float] = field(default_factory=list)  # rollout policy, one per completion token
    reward: float = 0.0
    group: int = 0  # samples of the same prompt share a group (the baseline is per group)
    ref_logprobs: list[float] = field(default_factory=list)  # frozen reference policy (with trainer.kl only)
    # With rollout.mismatch_correction, the engine's log-probs; old_logprobs then holds the trainer's own (pi_old
    # recomputed on the weights the engine sampled with) and is_weights each token's importance weight on the
    # policy gradient (orchestrator/iteration/mismatch.py)
    rollout_logprobs: list[float] = field(default_factory=list)
    is_weights: list[float] = field(default_factory=list)
    # Mixture-of-experts: the experts the rollout routed each input position to, int16 [len(prompt_ids) +
    # len(completion_ids) - 1, hidden layers, top_k], -1 where none (rollout/samples.py Sample.routed_experts)
    routed_experts: np.ndarray | None = None
    # Which completion tokens the loss trains on (1) and which it skips (0: tokens tide inserted into a multi-turn
    # trajectory, such as tool results); empty: every token. Counts, normalisers and statistics follow it.
    loss_mask: list[float] = field(default_factory=list)
    # The policy version that sampled each completion token (-1: inserted by tide); read by rollout.proximal
    # loglinear (LoglinearProximal), empty otherwise
    versions: list[int] = field(default_factory=list)

    @property
    def trained_mask(self) -> list[float]:
        return self.loss_mask if self.loss_mask else [1.0] * len(self.completion_ids)

    @property
    def trained_tokens(self) -> float:
        return float(sum(self.loss_mask)) if self.loss_mask else float(len(self.completion_ids))


@dataclass(frozen=True)
class TokenDistribution:
    """How the completions' tokens were drawn from the policy's logits z: softmax(z / temperature) restricted
    to the top_k most likely tokens (0: all) and then to the top_p nucleus (1.0: all), renormalised. The
    trainer's log-probs are those of this distribution, so that they compare with the rollout's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def is_raw(self) -> bool:
        """The model's own distribution: log-softmax of the unprocessed logits."""
        return self.temperature == 1.0 and not self.truncates


@dataclass(frozen=True)
class LoglinearProximal:
    """rollout.proximal loglinear (trainer/losses.py loglinear_proximal): pi_old, decoupled PPO's proximal policy,
    is interpolated between the engines' log-probs (the sequences' old_logprobs) and the trainer's current ones,
    per token by the optimizer steps from its sampler (TrainSequence.versions) to the policy `trained_by` that
    starts this train step, each past iteration counted as this train step's updates x epochs; each token's
    policy gradient is weighed by min(pi_old / pi_behaviour, tis_cap)."""

    trained_by: int
    tis_cap: float


@dataclass
class TrainBatch:
    sequences: list[TrainSequence]
    distribution: TokenDistribution = TokenDistribution()  # what old_logprobs (and the trainer's) refer to
    # old_logprobs are the trainer's recomputed pi_old, the engines' are rollout_logprobs, and every sequence has
    # its is_weights (rollout.mismatch_correction)
    old_recomputed: bool = False
    proximal: LoglinearProximal | None = None  # pi_old interpolated in the train step instead (rollout.proximal)
