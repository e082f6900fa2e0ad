"""What routing replay (trainer.moe.routing_replay, routing_replay.py) does to a train step, measured: how often the
trainer's routers choose other experts than the rollout did, and with replay the trainer-rollout log-prob gap of
the whole batch with the rollout's routing and with the trainer's own."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.batch import TokenDistribution, TrainSequence
from trainer.megatron.behaviour import behaviour_gaps
from trainer.megatron.logprobs import token_logprobs

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank


def replay_comparison(rank: MegatronRank, seqs: list[TrainSequence], seq_len: int, dist: TokenDistribution,
                      old_recomputed: bool) -> dict[str, float]:
    """With routing replay, before any update: the mean |trainer - rollout| log-prob over the whole batch
    with the rollout's routing (`behaviour_gap_replayed`) and with the trainer's own routers' choice
    (`behaviour_gap_unreplayed`); the sequences the two passes score differently (`replay_sequences_affected`:
    some token routed apart) and of those, how many replay brings closer to the rollout or farther; the
    routing metrics of the whole batch."""
    replayed, replayed_counts = _gap_pass(rank, seqs, seq_len, dist, old_recomputed, replay=True)
    free, free_counts = _gap_pass(rank, seqs, seq_len, dist, old_recomputed, replay=False)
    sums = torch.stack([replayed.sum(), free.sum(), (replayed != free).sum(), (replayed < free).sum(),
                        (replayed > free).sum()]).double()
    sums = rank.sum_over_dp_on_last_stage(sums)
    tokens = max(sum(s.trained_tokens for s in seqs), 1)
    return {"behaviour_gap_replayed": float(sums[0]) / tokens, "behaviour_gap_unreplayed": float(sums[1]) / tokens,
            "replay_sequences_affected": int(sums[2]), "replay_sequences_closer": int(sums[3]),
            "replay_sequences_farther": int(sums[4]), **routing_metrics(rank, replayed_counts, free_counts)}


def _gap_pass(rank: MegatronRank, seqs: list[TrainSequence], seq_len: int, dist: TokenDistribution,
              old_recomputed: bool, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward of the whole batch with or without routing replay: each of this rank's sequences' summed
    |trainer - rollout| log-prob (empty off the last pipeline stage) and this rank's routing counts."""
    mbs = rank.micro_batches(seqs, list(range(len(seqs))), None, seq_len)

    def loss_fn(mb, output):
        logp, _ = token_logprobs(output, mb, dist)
        return logp.new_zeros(()), {"gap": behaviour_gaps(logp, mb, old_recomputed).cpu()}

    from trainer.megatron.routing_replay import RoutingPass

    with torch.no_grad():
        out, counts = rank.run(mbs, loss_fn, seq_len, forward_only=True,
                               routing=RoutingPass(replay=replay, measure=True))
    return (torch.cat([d["gap"] for d in out]) if out else torch.zeros(0)), counts


def routing_metrics(rank: MegatronRank, trained: torch.Tensor, free: torch.Tensor) -> dict[str, float]:
    """Routing counts of one pass, summed over all ranks (each tensor-parallel group counted
    once): `routing_mismatch`, the share of (token, MoE layer) routings whose expert set the trainer's own
    router chooses otherwise than the rollout did, and `routing_mismatch_trained`, the share the loss's
    forward routed otherwise (0 with routing replay)."""
    import torch.distributed as torch_dist

    from trainer.megatron import routing_replay

    both = torch.stack([trained, free]).double()
    if rank.ps.get_tensor_model_parallel_rank() != 0:
        both.zero_()
    torch_dist.all_reduce(both)
    given = max(float(both[1, routing_replay.COUNTS.index("given")]), 1.0)
    return {"routing_mismatch": float(both[1, routing_replay.COUNTS.index("differs")]) / given,
            "routing_mismatch_trained": float(both[0, routing_replay.COUNTS.index("used_differs")]) / given,
            "routed_tokens": int(both[1, routing_replay.COUNTS.index("given")])}
