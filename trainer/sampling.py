"""The distribution a rollout sampled from, recomputed by the trainer: log-softmax of the logits divided by
the temperature, restricted to the top-k / top-p (nucleus) set and renormalised over it.

vLLM 0.32 samples exactly this way (`Sampler.sample`: temperature, then `apply_top_k_top_p`, then softmax)
and with `logprobs_mode="processed_logprobs"` returns the log-probs of that distribution. Returning raw
log-probs instead, as veRL and slime do by default, leaves the importance ratio biased by log(kept mass)
whenever top-p/top-k truncate (the "keep sampling mask" problem DeepSeek-V3.2 describes). The trainer
recomputes the truncation from its own logits with the same arithmetic as vLLM (`truncate_logits` mirrors
`apply_top_k_top_p_pytorch`, tested against it), and always keeps the token that was sampled in the set:
where trainer and engine logits differ in the last bits, a token at the very edge of the nucleus could
otherwise get probability 0 on the trainer's side although the engine sampled it.
"""
from __future__ import annotations

import torch

from trainer.batch import TokenDistribution


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` [..., V] with every token outside the top-k, then top-p, set to -inf (vLLM's order and
    arithmetic: ascending sort, keep logits >= the k-th largest, then drop the lowest tokens whose cumulative
    probability stays <= 1 - p, always keeping the largest)."""
    if top_k <= 0 and top_p >= 1.0:
        return logits
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    logits_sort, logits_idx = flat.sort(dim=-1, descending=False)
    if top_k > 0:
        kth = logits_sort[:, shape[-1] - min(top_k, shape[-1])].unsqueeze(1)
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if top_p < 1.0:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = probs_sum <= 1 - top_p
        drop[:, -1] = False
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return flat.scatter(-1, logits_idx, logits_sort).reshape(shape)


def kl_distribution(dist: TokenDistribution) -> TokenDistribution:
    """The distribution `trainer.kl` compares policy and reference under: `dist`'s temperature over the whole
    vocabulary, without its top-k / top-p truncation (a proper distribution on both sides; trainer/losses.py)."""
    return TokenDistribution(temperature=dist.temperature)


def processed_logits(logits: torch.Tensor, labels: torch.Tensor, dist: TokenDistribution) -> torch.Tensor:
    """`dist`'s logits over the full vocabulary [..., V]: divided by the temperature, -inf outside the kept
    top-k / top-p set (which always holds the sampled `labels`); differentiable where finite."""
    z = logits.float() / dist.temperature
    if dist.truncates:
        kept = truncate_logits(z.detach(), dist.top_k, dist.top_p)
        keep = torch.isfinite(kept)
        keep.scatter_(-1, labels.unsqueeze(-1), True)  # the sampled token is always in the set
        z = z.masked_fill(~keep, float("-inf"))
    return z


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, dist: TokenDistribution) -> torch.Tensor:
    """log p(label) under `dist` applied to full-vocabulary `logits` [..., V]; differentiable."""
    z = processed_logits(logits, labels, dist)
    return z.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) [...] over the last axis, in nats, where z may be -inf outside a kept set:
    H = logsumexp(z) - sum_i p_i z_i, with the excluded tokens' p_i = 0 and z_i read as 0, so that neither the
    value nor the gradient meets 0 x inf."""
    p = z.softmax(dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * torch.where(torch.isfinite(z), z, 0.0)).sum(-1)


def entropy_partials(z: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One vocabulary shard's part of the entropy of softmax(z) over the whole vocabulary (tensor parallelism):
    s = sum_i exp(z_i - m) and t = sum_i exp(z_i - m) z_i over the shard's tokens, m the maximum over all
    shards (no gradient). Summed over shards into S and T, `entropy_from_partials` gives the entropy."""
    e = torch.exp(z - m.unsqueeze(-1))
    return e.sum(-1), (e * z).sum(-1)


def entropy_from_partials(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """H = log sum_i exp(z_i) - sum_i p_i z_i = m + log S - T / S (see entropy_partials)."""
    return m + torch.log(s) - t / s
