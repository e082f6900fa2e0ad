"""A rank's share of a mini-batch as Megatron micro-batches: padded [rows, positions] tensors of the tokens, the
labels and every per-token field the loss reads (trainer.micro_batch_size rows, or with trainer.micro_batch_tokens
rows of similar length up to a budget of positions). Position t predicts token t + 1, so a completion's per-token
fields (mask, log-probs) sit at the positions from len(prompt) - 1 on.

Every data-parallel rank runs the same number of micro-batches of the same rows, also when the chunk does not
divide (dropped samples, a warm-start batch dp does not divide, 3 sequences on dp2): a rank short of sequences
fills rows with placeholders (a copy of the chunk's first sequence, mask 0, index -1), which add nothing to the
loss, its gradient or any statistic. A rank with fewer micro-batches would leave the others waiting in the
gradient all-reduce, the expert-parallel token exchange of every forward (EP groups span data-parallel ranks) or,
with rows of another count, in the pipeline's fixed-shape send/receive."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.batch import TrainSequence


def positions(s: TrainSequence) -> int:
    """Input positions of a sequence: position t predicts token t + 1."""
    return len(s.prompt_ids) + len(s.completion_ids) - 1


@dataclass(frozen=True)
class MicroBatcher:
    """How one rank cuts sequences: `rows` per micro-batch (trainer.micro_batch_size), or a `token_budget` of
    positions (trainer.micro_batch_tokens); `position_parts`: the tensor-parallel ranks sequence parallelism splits
    the positions over (1 without it), which every padded length is a multiple of."""

    rows: int
    token_budget: int | None
    position_parts: int

    def padded_len(self, n_positions: int) -> int:
        return -(-n_positions // self.position_parts) * self.position_parts

    def seq_len(self, seqs: list[TrainSequence]) -> int:
        """The padded length of the longest of `seqs`."""
        return self.padded_len(max((positions(s) for s in seqs), default=1))

    def micro_batches(self, seqs: list[TrainSequence], chunk: list[int], adv: torch.Tensor | None, seq_len: int,
                      dp: int, dp_rank: int) -> list[dict]:
        """Data-parallel rank `dp_rank`'s micro-batches (of `dp`) of the sequences `chunk`, padded to `seq_len` (with a
        token budget: each to its own longest)."""
        if self.token_budget:
            groups = self._token_budget_groups(seqs, chunk, dp, dp_rank)
        else:
            idx = chunk[dp_rank::dp]
            widest = -(-len(chunk) // dp)  # rank 0's share: the largest
            rows_per_mb = max(1, min(self.rows, widest))
            n_mbs = -(-widest // rows_per_mb)
            idx = idx + [-1] * (n_mbs * rows_per_mb - len(idx))
            groups = [idx[start:start + rows_per_mb] for start in range(0, len(idx), rows_per_mb)]
        stand_in = seqs[chunk[0]]

        def seq(i: int) -> TrainSequence:
            return seqs[i] if i >= 0 else stand_in

        def rows(chosen: list[int], field, seq_len: int) -> list[list]:
            out = []
            for i in chosen:
                s = seq(i)
                p, c = len(s.prompt_ids), len(s.completion_ids)
                values = (field(s) or [0.0] * c) if i >= 0 else [0.0] * c
                out.append([0.0] * (p - 1) + list(values) + [0.0] * (seq_len - p + 1 - c))
            return out

        from trainer.megatron.routing_replay import micro_batch_routing

        mbs = []
        for chosen in groups:
            if self.token_budget:  # padded to its own longest (the pipeline's fixed shape: pp 1)
                seq_len = self.padded_len(max(positions(seq(i)) for i in chosen))
            full = [seq(i).prompt_ids + seq(i).completion_ids for i in chosen]
            tokens = torch.tensor([f[:-1] + [0] * (seq_len + 1 - len(f)) for f in full], dtype=torch.long)
            labels = torch.tensor([f[1:] + [0] * (seq_len + 1 - len(f)) for f in full], dtype=torch.long)
            mask = torch.tensor(rows(chosen, lambda s: s.trained_mask, seq_len), dtype=torch.float32)
            old = torch.tensor(rows(chosen, lambda s: s.old_logprobs, seq_len), dtype=torch.float32)
            ref = torch.tensor(rows(chosen, lambda s: s.ref_logprobs, seq_len), dtype=torch.float32)
            behaviour = torch.tensor(rows(chosen, lambda s: s.rollout_logprobs, seq_len), dtype=torch.float32)
            is_weight = torch.tensor(rows(chosen, lambda s: s.is_weights, seq_len), dtype=torch.float32)
            versions = torch.tensor(rows(chosen, lambda s: s.versions, seq_len), dtype=torch.float32)
            routing = micro_batch_routing(
                [seqs[i].routed_experts if i >= 0 else None for i in chosen],
                [positions(seq(i)) for i in chosen], seq_len)
            mbs.append(dict(index=chosen, tokens=tokens, labels=labels, mask=mask, old=old, ref=ref,
                            rollout=behaviour, is_weight=is_weight, versions=versions, routing=routing,
                            position_ids=torch.arange(seq_len).unsqueeze(0).expand(len(chosen), -1),
                            adv=None if adv is None else torch.stack([adv[i] if i >= 0 else adv.new_zeros(())
                                                                      for i in chosen])))
        return mbs

    def _token_budget_groups(self, seqs: list[TrainSequence], chunk: list[int], dp: int,
                             dp_rank: int) -> list[list[int]]:
        """Rank `dp_rank`'s share of `chunk` sorted by length and cut greedily into groups of at most the budget's
        positions (rows x the group's padded longest; a longer sequence alone). Every data-parallel rank cuts every
        rank's share alike and fills up to the largest count with placeholder micro-batches (index -1), so that all
        run the same number."""
        budget = self.token_budget

        def cut(share: list[int]) -> list[list[int]]:
            groups: list[list[int]] = []
            for i in sorted(share, key=lambda i: (positions(seqs[i]), i)):
                width = self.padded_len(positions(seqs[i]))  # the longest so far: sorted ascending
                if groups and (len(groups[-1]) + 1) * width <= budget:
                    groups[-1].append(i)
                else:
                    groups.append([i])
            return groups

        shares = [cut(chunk[k::dp]) for k in range(dp)]
        n = max(len(g) for g in shares)
        return shares[dp_rank] + [[-1]] * (n - len(shares[dp_rank]))
