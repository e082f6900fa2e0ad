"""RL losses over per-token log-probs. Pure torch; every function is checked against hand-computed values in
tests/trainer/test_losses.py.

Shapes: logp, old_logp, mask are [B, T] (T = completion positions, mask 1 on real completion tokens);
advantages and rewards are [B]. `policy_loss` returns one micro-batch's part of the mini-batch objective:
it is given the mini-batch's sequence and token counts (over every micro-batch and data-parallel rank), so
the parts add up to the objective whatever the micro-batching and data parallelism.

Losses (`trainer.loss`):
- `kimi`: Kimi k1.5 (Kimi Team 2025, arXiv:2501.12599, section 2.3.2), the online mirror-descent surrogate per
  sampled completion y: -(r - mean r) log pi(y|x) + tau/2 (log pi(y|x) - log pi_old(y|x))^2, with
  log pi(y|x) the sum of the completion's token log-probs; averaged over completions.
- `kimi_token`: a variant (not the paper's): the same policy gradient, but the squared log-ratio taken per
  token and everything averaged over tokens. tide's `kimi` before the paper's form was adopted.
- `grpo`: the clipped surrogate of PPO (Schulman et al. 2017) with group-relative advantages and no critic
  (GRPO, Shao et al. 2024, arXiv:2402.03300), with
  - `loss_agg`: `seq_mean_token_mean` (GRPO's paper: mean over each completion's tokens, then over
    completions), `token_mean` (DAPO, Yu et al. 2025, arXiv:2503.14476: every token of the mini-batch
    weighs the same), `seq_mean_token_sum` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783: token sums averaged
    over completions; Dr. GRPO divides by a constant generation budget instead, which only rescales);
  - `adv_std_norm`: divide by the group's reward std (GRPO) or not (Dr. GRPO); the std is the population one
    (divided by n) or, with `adv_std_unbiased`, Bessel's (n - 1, as TRL and veRL compute it), plus
    `adv_std_eps`;
  - clip-higher (DAPO): ratio clipped to [1 - clip_eps_low, 1 + clip_eps_high].
  With `adv_std_norm: false` it is the clipped surrogate with a group-mean baseline that tide once called
  `ppo_clip` (not PPO: there is no critic).

`rollout.mismatch_correction` (orchestrator/iteration/mismatch.py: truncated, masked or IcePop importance sampling): the
engines sample from pi_rollout, which differs from the trainer's pi_old on the same weights (bfloat16, other
kernels). `old_logp` is then the trainer's recomputed pi_old and each token's policy-gradient term is multiplied
by its importance weight w_t (`is_weight`, computed by the driver, detached). For `kimi` the weight multiplies
each token's term of -(r - mean r) sum_t log pi(y_t); the squared log-ratio regulariser is not weighted.

`rollout.proximal: loglinear` (with max_staleness >= 1 and mismatch_correction tis): decoupled PPO's proximal
policy (Hilton et al. 2021, "Batch size-invariance for policy optimization", arXiv:2110.00641: pi_prox, the
trainer's policy before this iteration's updates) is not recomputed by a forward pass but interpolated in log space
between the behaviour policy's log-probs (the engines') and the current policy's (AReaL's `prox_logp_method:
loglinear`, also in slime): log pi_prox = log pi_b + alpha (log pi_theta - log pi_b), alpha = d / (d + k), with d
the optimizer steps between the token's sampler and pi_prox and k those taken since pi_prox (`loglinear_proximal`).
tide's variant: AReaL and slime count versions per train step (alpha fixed within it); tide counts optimizer steps,
so on the iteration's first mini-batch (k = 0: pi_theta is pi_prox) the value is exact, not an approximation. A
token of staleness 0 (d = 0: iteration 1, a token sampled in flight after the weight switch) would get alpha = 0 on
every later mini-batch, pi_prox = pi_b and weight 1, dropping the mismatch correction; its pi_prox is instead
computed, the trainer's pre-update policy by a forward pass before the first update (`logp_prox`, `known`;
trainer/megatron/behaviour.py), which is what lockstep's recomputed pi_old + tis gives it.

`trainer.kl` adds coef x a KL penalty to the loss, estimated per sampled token with Schulman's estimators
("Approximating KL Divergence", 2020), r = log pi_ref(y_t) - log pi(y_t): k1 = -r, k2 = r^2 / 2,
k3 = exp(r) - 1 - r (their values estimate KL(pi || pi_ref); the divergence their gradients follow is below);
summed over each completion and averaged over completions for `kimi` (a sequence-level objective), aggregated like
the policy loss otherwise.
- The distributions: both sides' tempered softmax over the whole vocabulary (`sampling.kl_distribution`, veRL's
  choice for its KL term), also when the rollout samples from a top-p / top-k set. The policy-gradient terms use
  the truncated distribution that was sampled; a reference truncated to its own nucleus with the sampled token
  forced in is no distribution (its values summed over the vocabulary exceed 1) and understates the penalty
  exactly where the policy drifts to tokens the reference would not sample. The tokens still come from the
  truncated policy, so the estimate sees the tokens of the kept set only (as veRL's does; the weight below
  corrects their proportions, not that).
- The gradients, used as a loss on tokens sampled from pi with the sampling not differentiated (Tang & Munos
  2025, "On a few pitfalls in KL divergence gradient estimation for RL"): E[grad k1] = E[grad log pi] = 0, so k1
  does not regularise and is refused as a loss (trainer/config.py); E[grad k2] = E[(log pi - log pi_ref) grad
  log pi] = grad KL(pi || pi_ref); E[grad k3] = E[(1 - pi_ref / pi) grad log pi] = grad KL(pi_ref || pi), the
  forward divergence, not the reverse one its value estimates. tests/trainer/test_losses.py checks all three
  against the exact gradients on a small vocabulary.
- Off-policy (`kl_importance_weight`): those expectations are over tokens sampled from pi. The tokens come from
  the behaviour policy pi_b: the engines' (their kernels), a stale policy (a batch drawn ahead; pi_old on every
  mini-batch after the first) and under top-p / top-k a truncated distribution. Each token's KL term is weighed by
  pi(y_t) / pi_b(y_t), importance sampling onto the KL term's distribution, so that E_b[weight x grad k] is
  the named divergence's gradient again: pi under the KL term's distribution over pi_old under the sampled one,
  times the policy term's mismatch weight w_t (pi_old / pi_b truncated or masked as configured; w_t = 1 and
  pi_old = pi_b without a correction; under rollout.proximal loglinear pi_old is pi_prox). That the KL term needs
  the importance weight off-policy as the policy term does is Zhang et al. 2025 ("On the Design of KL-Regularized
  Policy Gradient Algorithms for LLM Reasoning", arXiv:2505.17508; GRPO's KL term lacks it); a per-token ratio
  with the contexts as sampled is the token-level off-policy approximation the policy term makes too (Degris,
  White & Sutton 2012, "Off-Policy Actor-Critic", arXiv:1205.4839). tide's variant: the weight is detached (each
  estimator's gradient keeps the divergence named above) and its pi / pi_old factor is not clipped (PPO's clip
  is the surrogate's; only w_t is truncated, as configured). Checked exactly over a small vocabulary for stale
  and corrected batches: the weighted expectation is the named divergence's gradient, the unweighted one is not.
- The bias that remains under top-p / top-k: tokens outside the behaviour's kept set S are never sampled, so
  their part of the gradient, sum over y not in S of pi(y) grad k(y), is missing whatever the weight; the
  weighted expectation is the exact gradient less exactly that part (tested). On the policy's own samples the
  weight is the kept mass at the position (pi_KL / pi_sampled <= 1): it takes away the unweighted term's 1 / mass
  inflation and leaves the direction of each position's term. Measured over V = 50, top_p 0.7, logits N(0, s^2)
  with s in {1, 2, 3}, reference logits those + N(0, d^2) with d in {0.3, 1}, 20 seeds each (120 cases), cosine
  to the exact gradient and size relative to it, weighted (unweighted): on the policy's own samples k2 cosine
  0.56-0.996, median 0.94 (the same), size median 0.93, 0.02-1.10 (1.30, 0.03-1.52); k3 cosine median 0.95,
  size median 0.92, 0.07-1.02 (1.27, 0.07-1.45); sampled by a stale policy (its logits + N(0, 0.5^2)) k2 cosine
  median 0.91 (0.87), size 0.89 (1.40, up to 2.43); k3 0.93 (0.89), size 0.86 (1.32, up to 2.57). Without top-p
  the weighted term is exact (cosine 1, size 1) where the unweighted one had cosine down to 0.59 (k2) and 0.78
  (k3). The small sizes are peaked policies whose divergence from the reference lies in the tail. Only an exact
  sum over the vocabulary (the reference's whole distribution at each position, which the reference phase does
  not keep) would remove this part. Nor is the sequence-level part Tang & Munos describe (the policy's effect on
  later tokens' contexts) in any per-token estimator.

`trainer.entropy_coef` subtracts coef x H(pi(.|x, y_<t)) from the loss, H the entropy of the sampling
distribution at each completion position, aggregated like the KL term: entropy regularisation (Williams & Peng
1991, "Function optimization using connectionist reinforcement learning algorithms"; Mnih et al. 2016,
arXiv:1602.01783), veRL's `entropy_coeff`. Its gradient is the exact gradient of the entropy over the whole
vocabulary, not a sampled estimate.
"""
from __future__ import annotations

import math

import torch

from trainer.loss_spec import KLEstimator, LossAgg, LossKind, LossSpec  # noqa: F401  (this module's interface)


def group_baseline_advantages(rewards: torch.Tensor, groups: torch.Tensor, normalize_std: bool,
                              unbiased: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """r - mean(r over the samples of the same prompt); for GRPO divided by the group's std (population, or
    Bessel-corrected with `unbiased`) + eps. A group of one sample has advantage 0 (no std to divide by)."""
    adv = torch.empty_like(rewards)
    for g in torch.unique(groups):
        idx = groups == g
        r = rewards[idx]
        a = r - r.mean()
        if normalize_std:
            std = r.std(unbiased=unbiased) if r.numel() > 1 else r.new_zeros(())
            a = a / (std + eps)
        adv[idx] = a
    return adv


def advantages(spec: LossSpec, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return group_baseline_advantages(rewards, groups, normalize_std=spec.adv_std_norm,
                                     unbiased=spec.adv_std_unbiased, eps=spec.adv_std_eps)


def kimi_sequence_loss(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                       tau: float, is_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Kimi k1.5 per completion [B]: -(r - r_mean) log pi(y|x) + tau/2 (log pi(y|x) - log pi_old(y|x))^2
    (with `is_weight`: log pi(y|x) in the first term becomes sum_t w_t log pi(y_t))."""
    weighted = logp if is_weight is None else logp * is_weight
    seq_logp = (weighted * mask).sum(-1)
    log_ratio = ((logp - old_logp) * mask).sum(-1)
    return -adv * seq_logp + 0.5 * tau * log_ratio**2


def kimi_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, tau: float,
                    is_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The `kimi_token` variant per token [B, T]:
    -(r - r_mean) w_t log pi(y_t) + tau/2 (log pi(y_t) - log pi_old(y_t))^2 (w_t = 1 without `is_weight`)."""
    weighted = logp if is_weight is None else logp * is_weight
    return -adv[:, None] * weighted + 0.5 * tau * (logp - old_logp) ** 2


def clipped_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float,
                       eps_high: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate per token [B, T], ratio clipped to [1 - eps_low, 1 + eps_high]."""
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    return -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)


def clip_counts(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_low: float,
                eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """How many completion tokens the clipped surrogate holds at its lower and upper bound (no gradient flows
    through them there): ratio < 1 - eps_low with a negative advantage, ratio > 1 + eps_high with a positive
    one. TRL's `clip_ratio/low_mean` and `clip_ratio/high_mean` are these counts over the tokens."""
    ratio = torch.exp(logp.detach() - old_logp)
    a = adv[:, None]
    low = ((ratio < 1 - eps_low) & (a < 0)).float()
    high = ((ratio > 1 + eps_high) & (a > 0)).float()
    return (low * mask).sum(), (high * mask).sum()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: LossAgg, n_seqs: int, n_tokens: int) -> torch.Tensor:
    """This micro-batch's part of the mini-batch mean of per-token losses under `agg`."""
    masked = per_token * mask
    if agg == "token_mean":
        return masked.sum() / max(n_tokens, 1)
    if agg == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(n_seqs, 1)
    if agg == "seq_mean_token_sum":
        return masked.sum() / max(n_seqs, 1)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020)."""
    r = ref_logp - logp
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r**2
    if estimator == "k3":
        return torch.exp(r) - 1 - r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def masked_reference(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`ref_logp` on completion tokens, the policy's own (detached) elsewhere: positions outside the mask hold
    placeholders, and exp(placeholder - log pi) could overflow to inf, which times a zero mask is NaN."""
    return torch.where(mask > 0, ref_logp, logp.detach())


def policy_loss(spec: LossSpec, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                n_seqs: int, n_tokens: int, ref_logp: torch.Tensor | None = None,
                is_weight: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                kl_logp: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's part of the mini-batch objective (`n_seqs`, `n_tokens`: the mini-batch's counts),
    plus the reference KL term when `spec.kl_coef` > 0 (then `ref_logp` is required) and minus the entropy bonus
    when `spec.entropy_coef` > 0 (then `entropy` [B, T], differentiable, is required); `is_weight` [B, T]:
    importance weights (rollout.mismatch_correction) on the policy-gradient term. `kl_logp`: the policy's
    differentiable log-probs under the KL term's distribution (`sampling.kl_distribution`), where it differs
    from the sampled one `logp` is taken under (top-p / top-k); `ref_logp` is under that distribution too."""
    loss = _surrogate(spec, logp, old_logp, mask, adv, n_seqs, n_tokens, is_weight)
    if spec.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("trainer.kl.coef > 0 needs the reference policy's log-probs")
        kl_logp = logp if kl_logp is None else kl_logp
        kl = kl_estimate(kl_logp, masked_reference(kl_logp, ref_logp, mask), spec.kl_estimator)
        kl = kl * kl_importance_weight(kl_logp, old_logp, mask, is_weight)
        loss = loss + spec.kl_coef * aggregate(kl, mask, spec.kl_agg, n_seqs, n_tokens)
    if spec.entropy_coef > 0:
        if entropy is None:
            raise ValueError("trainer.entropy_coef > 0 needs the entropy at each completion position")
        loss = loss - spec.entropy_coef * aggregate(entropy, mask, spec.kl_agg, n_seqs, n_tokens)
    return loss


def _surrogate(spec: LossSpec, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
               n_seqs: int, n_tokens: int, w: torch.Tensor | None) -> torch.Tensor:
    if spec.kind == "kimi":
        return kimi_sequence_loss(logp, old_logp, mask, adv, spec.kimi_tau, w).sum() / max(n_seqs, 1)
    if spec.kind == "kimi_token":
        per_token = kimi_token_loss(logp, old_logp, adv, spec.kimi_tau, w)
        return aggregate(per_token, mask, "token_mean", n_seqs, n_tokens)
    if spec.kind == "grpo":
        per_token = clipped_token_loss(logp, old_logp, adv, spec.clip_eps_low, spec.clip_eps_high)
        if w is not None:
            per_token = per_token * w
        return aggregate(per_token, mask, spec.agg, n_seqs, n_tokens)
    raise ValueError(f"unknown loss {spec.kind!r}")


def loglinear_proximal(logp_now: torch.Tensor, logp_behaviour: torch.Tensor, steps_behind: torch.Tensor,
                       steps_taken: int, tis_cap: float, logp_prox: torch.Tensor | None = None,
                       known: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rollout.proximal: loglinear` (module docstring): per token, log pi_prox approximated from the current
    policy's log-probs `logp_now` (detached here) and the behaviour policy's, with `steps_behind` the optimizer
    steps from the token's sampler to pi_prox and `steps_taken` those since pi_prox; and the truncated importance
    weight min(pi_prox / pi_b, tis_cap) (orchestrator/iteration/mismatch.py's tis). Both are constants of the loss.
    `logp_prox` where `known` (bool): pi_prox itself, computed by the trainer, taken instead of the interpolation
    (the staleness-0 tokens of later mini-batches, whose d = 0 would make pi_prox the engine's)."""
    now, behaviour = logp_now.detach().float(), logp_behaviour.float()
    if steps_taken == 0:  # pi_theta is pi_prox: exact
        prox = now
    else:
        alpha = steps_behind / (steps_behind + steps_taken)
        prox = behaviour + alpha * (now - behaviour)
        if known is not None:
            prox = torch.where(known, logp_prox.detach().float(), prox)
    weight = torch.exp(torch.clamp(prox - behaviour, max=math.log(tis_cap)))
    return prox, weight


def kl_importance_weight(kl_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                         is_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The KL term's per-token importance weight (module docstring), a constant of the loss: pi_theta(y_t) under the
    KL term's distribution over pi_old(y_t) under the sampled one, times the mismatch correction's weight
    `is_weight` (pi_old / pi_behaviour, truncated or masked as configured; 1 without one, pi_old being then the
    behaviour policy). 1 outside the mask, where `old_logp` holds placeholders."""
    log_ratio = torch.where(mask > 0, kl_logp.detach() - old_logp, 0.0)
    weight = torch.exp(log_ratio)
    return weight if is_weight is None else weight * is_weight


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
