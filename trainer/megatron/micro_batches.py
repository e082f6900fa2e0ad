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
from trainer.megatron.packing import packed_groups, packed_micro_batch
from trainer.megatron.token_fields import per_token_rows, positions


@dataclass(frozen=True)
class MicroBatcher:
    """How one rank cuts sequences: `rows` per micro-batch (trainer.micro_batch_size), or a `token_budget` of
    positions (trainer.micro_batch_tokens); `position_parts`: the tensor-parallel ranks sequence parallelism splits
    the positions over (1 without it), which every padded length is a multiple of."""

    rows: int
    token_budget: int | None
    position_parts: int
    packed: bool = False

    def padded_len(self, n_positions: int) -> int:
        return -(-n_positions // self.position_parts) * self.position_parts

    def seq_len(self, seqs: list[TrainSequence]) -> int:
        """The padded length of the longest of `seqs`."""
        return self.padded_len(max((positions(s) for s in seqs), default=1))

    def micro_batches(self, seqs: list[TrainSequence], chunk: list[int], adv: torch.Tensor | None, seq_len: int,
                      dp: int, dp_rank: int) -> list[dict]:
        """Data-parallel rank `dp_rank`'s micro-batches (of `dp`) of the sequences `chunk`, padded to `seq_len` (with a
        token budget: each to its own longest)."""
        if self.packed:
            groups = packed_groups([[(i, positions(seqs[i])) for i in chunk[k::dp]] for k in range(dp)],
                                   self.token_budget)[dp_rank]
        elif self.token_budget:
            groups = self._token_budget_groups(seqs, chunk, dp, dp_rank)
        else:
            idx = chunk[dp_rank::dp]
            widest = -(-len(chunk) // dp)  # rank 0's share: the largest
            rows_per_mb = max(1, min(self.rows, widest))
            n_mbs = -(-widest // rows_per_mb)
            idx = idx + [-1] * (n_mbs * rows_per_mb - len(idx))
            groups = [idx[start:start + rows_per_mb] for start in range(0, len(idx), rows_per_mb)]
        stand_in = seqs[chunk[0]]
        mbs = []
        for chosen in groups:
            rows = [seqs[i] if i >= 0 else stand_in for i in chosen]
            if self.packed:
                mb = packed_micro_batch(rows, [i >= 0 for i in chosen], self.position_parts)
            else:
                if self.token_budget:  # padded to its own longest (the pipeline's fixed shape: pp 1)
                    seq_len = self.padded_len(max(positions(s) for s in rows))
                mb = padded_micro_batch(rows, [i >= 0 for i in chosen], seq_len)
            mb.update(index=chosen, adv=None if adv is None else torch.stack(
                [adv[i] if i >= 0 else adv.new_zeros(()) for i in chosen]))
            mbs.append(mb)
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


def padded_micro_batch(rows: list[TrainSequence], real: list[bool], seq_len: int) -> dict:
    """[len(rows), seq_len] tensors: each sequence in a row of its own, padded to `seq_len`."""
    full = [s.prompt_ids + s.completion_ids for s in rows]
    return dict(tokens=torch.tensor([f[:-1] + [0] * (seq_len + 1 - len(f)) for f in full], dtype=torch.long),
                labels=torch.tensor([f[1:] + [0] * (seq_len + 1 - len(f)) for f in full], dtype=torch.long),
                position_ids=torch.arange(seq_len).unsqueeze(0).expand(len(rows), -1),
                **per_token_rows(rows, real, seq_len))

