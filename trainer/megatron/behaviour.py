"""What a train step knows of the policy that sampled its batch (trainer/megatron/train_step.py): the mini-batches
it cuts, the trainer-engine log-prob gap, and with `rollout.proximal: loglinear` each token's pi_old (decoupled
PPO's proximal policy, trainer/losses.py loglinear_proximal) and its truncated importance weight.

pi_prox is the trainer's policy before the iteration's first update, for every token. The interpolation
approximates it from the behaviour policy and the current one; for a token of staleness 0 (sampled by the
weights pi_prox has: iteration 1, which is lockstep, and tokens sampled in flight after the weight switch) it
gives alpha = 0 on every mini-batch after the first, pi_prox = the engine's log-prob and weight 1, which drops the
train-inference mismatch correction for those tokens (issue 58 item 6). So they get pi_prox itself: one
forward-only pass of the current policy, before the iteration's first update, over the sequences that hold such
tokens and are trained after an update (`computed_proximal`) -- the value lockstep's recomputed pi_old gives them,
with tis's min(pi_prox / pi_b, tis_cap). Tokens of staleness >= 1 keep the interpolation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trainer.batch import LoglinearProximal, TokenDistribution, TrainSequence
from trainer.losses import loglinear_proximal
from trainer.megatron.scoring import completion_logprobs

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank
    from trainer.megatron.routing_replay import RoutingPass


def minibatch_bounds(n: int, updates: int) -> tuple[list[tuple[int, int]], int]:
    """The batch's `n` samples cut into `updates` mini-batches of consecutive positions (in the step's order), as
    (lo, hi) pairs; with fewer samples than mini-batches (reward functions that return None drop samples) into one
    per sample instead: a mini-batch with no sample would have nothing to step on (it raised IndexError). Returns
    the cuts and how many of the `updates` mini-batches that leaves out. Every rank holds the whole batch and cuts
    it alike, so every data-parallel rank takes the same steps."""
    parts = min(n, updates)
    bounds = [n * k // parts for k in range(parts + 1)] if parts else [0]
    return list(zip(bounds, bounds[1:])), updates - parts


def behaviour_gaps(logp: torch.Tensor, mb: dict, old_recomputed: bool) -> torch.Tensor:
    """Per sequence of a micro-batch, the summed |trainer - engines| log-prob over its completion tokens: against
    the engines' own log-probs (`rollout`) when pi_old was recomputed (mismatch correction), else against pi_old
    (the same log-probs when the batch is fresh)."""
    behaviour = (mb["rollout"] if old_recomputed else mb["old"]).to(logp.device)
    return ((logp.detach().float() - behaviour).abs() * mb["mask"].to(logp.device)).sum(-1)


def fresh_sequences(seqs: list[TrainSequence], indices: list[int], proximal: LoglinearProximal) -> list[int]:
    """Those of `indices` with a trained token of staleness 0 (sampled by the version `proximal.trained_by`; a
    sequence without versions counts as version 0, as the train step's rows read it)."""
    return [i for i in indices if any(m > 0 and v >= proximal.trained_by for m, v in zip(
        seqs[i].trained_mask, seqs[i].versions or [0] * len(seqs[i].completion_ids)))]


@torch.no_grad()
def computed_proximal(rank: MegatronRank, seqs: list[TrainSequence], indices: list[int], seq_len: int,
                      dist: TokenDistribution, routing: RoutingPass) -> dict[int, torch.Tensor]:
    """The current policy's log-probs of every completion token of the sequences `indices` (a forward-only pass,
    each data-parallel rank its share, gathered over the data-parallel group): {sequence index: [completion
    tokens]} on the last pipeline stage, where the loss reads them; empty elsewhere. Every rank takes part."""
    if not indices:
        return {}
    mine = completion_logprobs(rank, seqs, indices, seq_len, dist, routing)
    ps = rank.ps
    if not ps.is_pipeline_last_stage() or ps.get_data_parallel_world_size() == 1:
        return mine
    import torch.distributed as dist_

    shares: list = [None] * ps.get_data_parallel_world_size()
    dist_.all_gather_object(shares, mine, group=ps.get_data_parallel_group())
    return {i: v for share in shares for i, v in share.items()}


@dataclass
class ProximalStep:
    """rollout.proximal loglinear within one train step: each past iteration counts as `steps_per_iteration`
    optimizer steps; `computed`: computed_proximal's values, filled before the step's first update."""

    spec: LoglinearProximal
    steps_per_iteration: int
    seqs: list[TrainSequence]
    computed: dict[int, torch.Tensor] = field(default_factory=dict)

    def terms(self, mb: dict, logp: torch.Tensor, steps_taken: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One micro-batch's pi_old and TIS weights (`mb["old"]` holds the engines' log-probs, the behaviour
        policy's): interpolated by each token's optimizer steps from its sampler to pi_prox (its staleness in
        iterations x steps_per_iteration) and `steps_taken` since pi_prox; where the token's staleness is 0 and
        `computed` holds its sequence, the computed pi_prox. Returns pi_old, the weights, their sum over the
        trained tokens and how many of those the cap truncates."""
        device, cap = logp.device, self.spec.tis_cap
        mask, behaviour = mb["mask"].to(device), mb["old"].to(device)
        behind = (self.spec.trained_by - mb["versions"].to(device)).clamp(min=0)
        values, known = torch.zeros_like(behaviour), torch.zeros_like(behaviour, dtype=torch.bool)
        for row, i in enumerate(mb["index"]):
            if i >= 0 and i in self.computed:
                p, c = len(self.seqs[i].prompt_ids), len(self.seqs[i].completion_ids)
                values[row, p - 1:p - 1 + c] = self.computed[i].to(device)
                known[row, p - 1:p - 1 + c] = True
        old, w = loglinear_proximal(logp, behaviour, behind * self.steps_per_iteration, steps_taken, cap,
                                    logp_prox=values, known=known & (behind == 0))
        truncated = (((old - behaviour) > math.log(cap)).float() * mask).sum()
        return old, w, (w * mask).sum(), truncated
