"""A rank's train step: the batch's advantages, its mini-batches (one optimizer step each, over `epochs` passes),
each mini-batch's forward and backward with the RL loss (or the supervised one) and the statistics the iteration
reports."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
from trainer.losses import advantages, clip_counts, kl_estimate, kl_importance_weight, masked_reference, policy_loss
from trainer.megatron.behaviour import (ProximalStep, behaviour_gaps, computed_proximal, fresh_sequences,
                                        minibatch_bounds)
from trainer.megatron.logprobs import token_logprobs
from trainer.megatron.routing_metrics import replay_comparison, routing_metrics
from trainer.sampling import kl_distribution

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank
    from trainer.megatron.routing_replay import RoutingPass

# What a train step sums per optimizer step (over micro-batches and data-parallel ranks)
STATS = ("loss", "logp", "sq_log_ratio", "kl_ref", "gap", "entropy", "clip_low", "clip_high", "is_weight",
         "is_truncated", "packed_rows", "packed_sequences")


def train_step(rank: MegatronRank, batch: TrainBatch, mode: str = "rl", lr: float | None = None,
               updates: int = 1, shuffle_seed: int | None = None, epochs: int = 1) -> dict[str, float]:
    """Optimizer steps on the batch (`mode` "rl" uses the configured RL loss, "sft" the negative
    log-likelihood of the completions) at learning rate `lr` (default: the configured one). The batch is
    cut into `updates` mini-batches, one optimizer step each: consecutive ones, or, with `shuffle_seed`, of
    a seeded permutation (each step then mixes prompts, as TRL's and veRL's mini-batches do); advantages
    are computed over the whole batch first, so a prompt's baseline always sees all of its samples. With
    `epochs` > 1 (trainer.epochs) the batch is gone through that many times, each time in a new order,
    against the same old log-probs."""
    for group in rank.optimizer.param_groups:
        group["lr"] = rank.spec.trainer.lr if lr is None else lr
    seqs = batch.sequences
    seq_len = rank.seq_len(seqs)
    rewards = torch.tensor([s.reward for s in seqs], dtype=torch.float32)
    groups = torch.tensor([s.group for s in seqs])
    adv = advantages(rank.loss_spec, rewards, groups) if mode == "rl" else None
    _check_sequences(rank, batch, mode)
    from trainer.megatron.routing_replay import RoutingPass

    dist = batch.distribution if mode == "rl" else TokenDistribution()
    cuts, skipped = minibatch_bounds(len(seqs), updates)
    if skipped and rank.rank == 0:
        logging.getLogger(__name__).warning(f"{len(seqs)} samples for {updates} mini-batches: {skipped} skipped "
                                            f"each epoch (one sample each)")
    proximal = ProximalStep(batch.proximal, updates * epochs, seqs) if mode == "rl" and batch.proximal else None
    shuffle = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    stats, grad_norms, gap, kl_first = torch.zeros(len(STATS)), [], float("nan"), float("nan")
    routed = mode == "rl" and bool(rank.routers) and any(s.routed_experts is not None for s in seqs)
    if mode == "rl" and rank.routing_replay and not routed:
        raise ValueError("trainer.moe.routing_replay is rollout but no sequence carries the rollout's routing "
                         "(rollout.record_routing)")
    replay = mode == "rl" and rank.routing_replay
    # With replay, what it does is measured on the whole batch before any update: the gap to the rollout with
    # the rollout's routing and with the trainer's own (two forward passes; a mini-batch holds too few
    # sequences routed apart for the comparison to rise above bf16 rounding)
    routing_stats = replay_comparison(rank, seqs, seq_len, dist, batch.old_recomputed) if routed and replay else {}
    for epoch in range(epochs):  # each pass over the batch in a new seeded order
        order = list(range(len(seqs))) if shuffle is None else \
            torch.randperm(len(seqs), generator=shuffle).tolist()
        for k, (lo, hi) in enumerate(cuts):
            chunk = order[lo:hi]
            first = epoch == 0 and k == 0
            if first and proximal:  # pi_prox of the staleness-0 tokens trained after an update (behaviour.py)
                proximal.computed = computed_proximal(rank, seqs, fresh_sequences(
                    seqs, order if epochs > 1 else order[hi:], batch.proximal), seq_len, dist,
                    RoutingPass(replay=replay))
            chunk_tokens = max(sum(seqs[i].trained_tokens for i in chunk), 1)
            how = RoutingPass(replay=replay, measure=first and routed and not replay)
            # A GRPO mini-batch with no learning signal (every advantage zero, no KL or entropy term) takes no
            # optimizer step: its gradient is zero, and Adam would still move every weight on its momentum
            # (measured: a tiny policy wrecked within two iterations of all-zero advantages after one
            # rewarded sample). Kimi's losses pull towards pi_old even then: they always step. Every rank
            # holds the whole batch's advantages: they all decide alike.
            spec = rank.loss_spec
            signal = (mode != "rl" or spec.kind != "grpo" or spec.kl_coef > 0 or spec.entropy_coef > 0
                      or any(adv[i] != 0 and seqs[i].trained_tokens > 0 for i in chunk))
            step_stats, grad_norm, counts = _optimizer_step(
                rank, seqs, chunk, adv, seq_len, mode, dist, batch.old_recomputed, how, step=signal,
                proximal=proximal, steps_taken=len(grad_norms))
            if first:
                gap = float(step_stats[STATS.index("gap")]) / chunk_tokens
                kl_first = float(step_stats[STATS.index("kl_ref")]) / chunk_tokens
                if routed and not replay:
                    routing_stats = routing_metrics(rank, counts, counts)
            stats += step_stats
            if signal:
                grad_norms.append(grad_norm)
    tokens = float(sum(s.trained_tokens for s in seqs))
    per_token = {name: float(v) / max(tokens * epochs, 1.0) for name, v in zip(STATS, stats.tolist())}
    out = {"loss": float(stats[0]) / max(len(cuts) * epochs, 1), "logp_mean": per_token["logp"],
           "sq_log_ratio": per_token["sq_log_ratio"], "entropy": per_token["entropy"],
           "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0, "tokens": int(tokens),
           "optimizer_steps": len(grad_norms), "lr": _applied_lr(rank), "skipped_minibatches": skipped * epochs,
           # mean |trainer - rollout| log-prob over the first mini-batch's tokens, computed before any
           # update (the loss needs those log-probs anyway): with the engines in sync it is ~0
           "behaviour_gap": gap if mode == "rl" else float("nan"),
           "reporting": rank.reporting_rank()}
    packed_rows = float(stats[STATS.index("packed_rows")])
    if packed_rows:  # every optimizer step's packed rows, over data-parallel ranks, and their mean occupancy
        out |= {"packed_rows": int(packed_rows),
                "packed_sequences_per_row": float(stats[STATS.index("packed_sequences")]) / packed_rows}
    if mode == "rl" and rank.reference is not None:
        # kl_ref: the first mini-batch before its update, on the tokens the policy itself sampled (later
        # mini-batches estimate it on tokens an earlier policy sampled); kl_ref_mean: what the loss term
        # saw, over every mini-batch and epoch (TRL's `kl`, veRL's `actor/kl_loss`)
        out |= {"kl_ref": kl_first, "kl_ref_mean": per_token["kl_ref"]}
    if mode == "rl" and rank.loss_spec.kind == "grpo":
        out |= {"clip_fraction_low": per_token["clip_low"], "clip_fraction_high": per_token["clip_high"]}
    if mode == "rl" and batch.proximal is not None:  # the interpolated pi_old's weights, every mini-batch's
        out |= {"is_weight_mean": per_token["is_weight"], "is_truncated_frac": per_token["is_truncated"]}
    return out | routing_stats


def _check_sequences(rank: MegatronRank, batch: TrainBatch, mode: str) -> None:
    """What the loss will read of every sequence is there, in the lengths of its completion."""
    seqs = batch.sequences
    if mode == "rl" and rank.reference is not None and any(len(s.ref_logprobs) != len(s.completion_ids)
                                                           for s in seqs):
        raise ValueError("trainer.kl is on: every sequence needs the reference's log-probs (ref_logprobs)")
    bad = next((s for s in seqs if s.loss_mask and len(s.loss_mask) != len(s.completion_ids)), None)
    if bad is not None:
        raise ValueError(f"a sequence's loss_mask has {len(bad.loss_mask)} entries for "
                         f"{len(bad.completion_ids)} completion tokens")
    if mode == "rl" and batch.old_recomputed and any(
            len(s.rollout_logprobs) != len(s.completion_ids) or len(s.is_weights) != len(s.completion_ids)
            for s in seqs):
        raise ValueError("a mismatch correction needs every sequence's rollout_logprobs and is_weights")


def _applied_lr(rank: MegatronRank) -> float:
    """The rate the optimizer's own parameter groups (torch's Adam inside Megatron's wrappers) stepped with."""
    rates = {group["lr"] for group in rank.optimizer.param_groups}
    if len(rates) != 1:
        raise RuntimeError(f"the optimizer's parameter groups disagree on the learning rate: {sorted(rates)}")
    return float(rates.pop())


def _optimizer_step(rank: MegatronRank, seqs: list[TrainSequence], chunk: list[int], adv: torch.Tensor | None,
                    seq_len: int, mode: str, dist: TokenDistribution, old_recomputed: bool,
                    routing: RoutingPass | None = None, step: bool = True,
                    proximal: ProximalStep | None = None, steps_taken: int = 0
                    ) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Forward and backward over the mini-batch `chunk` (its statistics), then the optimizer's step; with
    `step` false, the forward only (its statistics; a gradient nobody applies is not computed). `proximal`:
    pi_old made here (rollout.proximal loglinear, behaviour.ProximalStep), `steps_taken` optimizer steps after
    pi_old."""
    dp = rank.ps.get_data_parallel_world_size()
    # a sequence the mismatch correction left out whole (trained_tokens 0) counts in no denominator
    n_seqs = sum(1 for i in chunk if seqs[i].trained_tokens > 0)
    n_tokens = sum(seqs[i].trained_tokens for i in chunk)
    mbs = rank.micro_batches(seqs, chunk, adv, seq_len)
    # Each micro-batch's loss is its part of the mini-batch objective (normalised by the mini-batch's
    # counts); the schedule divides by the number of micro-batches and DDP averages over data-parallel
    # ranks, which the factor undoes.
    scale = len(mbs) * dp

    spec = rank.loss_spec
    entropy_grad = mode == "rl" and spec.entropy_coef > 0

    def loss_fn(mb, output):
        logp, ent = token_logprobs(output, mb, dist, "grad" if entropy_grad else "metric")
        mask = mb["mask"].to(logp.device)
        old = mb["old"].to(logp.device)
        sq = kl = gap = clip_low = clip_high = is_weight = truncated = logp.new_zeros(())
        w = mb["is_weight"].to(logp.device) if old_recomputed else None
        if proximal is not None:  # old: the engines' log-probs, the behaviour policy's
            old, w, is_weight, truncated = proximal.terms(mb, logp, steps_taken)
        if mode == "sft":
            loss = -(logp * mask).sum() / max(n_tokens, 1)
        else:
            adv_mb = mb["adv"].to(logp.device)
            ref = mb["ref"].to(logp.device) if rank.reference is not None else None
            kl_logp = None
            if ref is not None:  # the KL term's distribution: the whole tempered vocabulary (kl_distribution)
                kl_logp = token_logprobs(output, mb, kl_distribution(dist))[0] if dist.truncates else logp
            loss = policy_loss(spec, logp, old, mask, adv_mb, n_seqs, n_tokens, ref, is_weight=w, entropy=ent,
                               kl_logp=kl_logp)
            sq = (((logp - old) ** 2) * mask).sum()
            gap = behaviour_gaps(logp, mb, old_recomputed).sum()
            if ref is not None:
                ref = masked_reference(kl_logp, ref, mask)  # weighed as the loss weighs it: what the term saw
                kl = (kl_estimate(kl_logp.detach(), ref, spec.kl_estimator) * mask
                      * kl_importance_weight(kl_logp, old, mask, w)).sum()
            if spec.kind == "grpo":
                clip_low, clip_high = clip_counts(logp, old, adv_mb, mask, spec.clip_eps_low, spec.clip_eps_high)
        packed = "cu_seqlens" in mb  # one row of sequences back to back (trainer.packing)
        stats = torch.stack([loss.detach(), (logp.detach() * mask).sum(), sq.detach(), kl, gap,
                             (ent.detach() * mask).sum(), clip_low, clip_high, is_weight, truncated,
                             logp.new_tensor(float(packed)),
                             logp.new_tensor(float(packed and sum(i >= 0 for i in mb["index"])))])
        return loss * scale, {"stats": stats}

    rank.model.zero_grad_buffer()
    rank.optimizer.zero_grad()
    out, counts = rank.run(mbs, loss_fn, seq_len, forward_only=not step, routing=routing)
    grad_norm = 0.0
    if step:
        ok, grad_norm, _ = rank.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
    stats = torch.zeros(len(STATS))
    for d in out:
        stats += d["stats"].cpu()
    return rank.sum_over_dp_on_last_stage(stats), float(grad_norm or 0.0), counts
