"""Forward-only passes that score sequences on a rank: the teacher-forced log-probs of completion tokens (of the
policy, the frozen reference or the behaviour snapshot) and full-vocabulary logits."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
from trainer.megatron.logprobs import full_logits, token_logprobs
from trainer.megatron.packing import unpack
from trainer.sampling import kl_distribution

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank
    from trainer.megatron.routing_replay import RoutingPass


def completion_logprobs(rank: MegatronRank, seqs: list[TrainSequence], indices: list[int], seq_len: int,
                        dist: TokenDistribution, routing: RoutingPass, model=None) -> dict[int, torch.Tensor]:
    """The log-probs under `dist` of every completion token of the sequences `indices` (this rank's data-parallel
    share), of `model` (None: the policy): {sequence index: [completion tokens]} on the last pipeline stage;
    empty elsewhere. Every rank takes part."""
    mbs = rank.micro_batches(seqs, indices, None, seq_len)

    def loss_fn(mb, output):
        logp, _ = token_logprobs(output, mb, dist)
        return logp.new_zeros(()), {"index": mb["index"], "logp": logp.float().cpu()}

    out, _ = rank.run(mbs, loss_fn, seq_len, forward_only=True, model=model, routing=routing)
    result: dict[int, torch.Tensor] = {}
    for d in out:
        for row, i in enumerate(d["index"]):
            if i >= 0:  # not a placeholder row (micro_batches.py)
                p, c = len(seqs[i].prompt_ids), len(seqs[i].completion_ids)
                result[i] = d["logp"][row, p - 1:p - 1 + c].clone()
    return result


@torch.no_grad()
def logprobs(rank: MegatronRank, batch: TrainBatch, reference: bool = False,
             behaviour: bool = False) -> dict[int, list[float]] | None:
    """Teacher-forced log-probs of every completion token under `batch.distribution`, of the policy, of the frozen
    reference (trainer.kl) or of the behaviour snapshot (`snapshot_behaviour`). Returns {sequence index:
    [logp...]} on the ranks that hold results (last pipeline stage, TP rank 0); None elsewhere."""
    from trainer.megatron.routing_replay import RoutingPass

    if reference and rank.reference is None:
        raise RuntimeError("no reference model: trainer.kl.coef is 0")
    if behaviour and rank.behaviour is None:
        raise RuntimeError("no behaviour snapshot: snapshot_behaviour() was never called")
    seqs = batch.sequences
    # the reference serves the KL term only, whose distribution is the whole tempered vocabulary
    dist = kl_distribution(batch.distribution) if reference else batch.distribution
    model = rank.reference if reference else rank.behaviour if behaviour else None
    scored = completion_logprobs(rank, seqs, list(range(len(seqs))), rank.seq_len(seqs), dist,
                                 RoutingPass(replay=rank.routing_replay), model=model)
    if not rank.reporting_rank():
        return None
    return {i: logp.tolist() for i, logp in scored.items()}


@torch.no_grad()
def logits(rank: MegatronRank, token_lists: list[list[int]]) -> list[torch.Tensor] | None:
    """Full-vocabulary logits [len, vocab] per sequence (TP shards gathered); None off the reporting ranks. For
    checking conversions against another implementation."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seqs = [TrainSequence(t + [0], []) for t in token_lists]  # micro-batches drop the last token
    seq_len = rank.seq_len(seqs)
    mbs = rank.micro_batches(seqs, list(range(len(seqs))), None, seq_len, split=False)

    def loss_fn(mb, output):
        full = unpack(gather_from_tensor_model_parallel_region(full_logits(output).float()), mb)
        return full.new_zeros(()), {"index": mb["index"], "logits": full.cpu()}

    out, _ = rank.run(mbs, loss_fn, seq_len, forward_only=True)
    if not rank.reporting_rank():
        return None
    result = {}
    for d in out:
        for row, i in enumerate(d["index"]):
            if i >= 0:
                result[i] = d["logits"][row, : len(token_lists[i])]
    return [result[i] for i in range(len(token_lists))]
