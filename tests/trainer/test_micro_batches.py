"""trainer/megatron/micro_batches.py without ranks: every data-parallel rank gets the same number of micro-batches
of the same rows, a short share filled with placeholders that train nothing, and a token budget cuts sorted
sequences into groups within it."""
from __future__ import annotations

import torch

from trainer.batch import TrainSequence
from trainer.megatron.micro_batches import MicroBatcher, positions


def _seqs(lengths: list[tuple[int, int]]) -> list[TrainSequence]:
    return [TrainSequence(list(range(3, 3 + p)), list(range(10, 10 + c)), reward=1.0) for p, c in lengths]


def test_a_short_data_parallel_share_is_filled_with_placeholders():
    seqs = _seqs([(3, 2), (4, 3), (2, 4)])
    batcher = MicroBatcher(rows=2, token_budget=None, position_parts=1)
    seq_len = batcher.seq_len(seqs)
    assert seq_len == max(positions(s) for s in seqs) == 6
    shares = [batcher.micro_batches(seqs, [0, 1, 2], None, seq_len, dp=2, dp_rank=r) for r in (0, 1)]
    assert [[mb["index"] for mb in share] for share in shares] == [[[0, 2]], [[1, -1]]]
    placeholder = shares[1][0]
    assert placeholder["tokens"].shape == shares[0][0]["tokens"].shape == (2, seq_len)
    assert placeholder["mask"][1].sum() == 0 and placeholder["mask"][0].sum() == 3
    # a completion's fields start at the position that predicts its first token: len(prompt) - 1
    assert torch.equal(placeholder["labels"][0, 3:6], torch.tensor([10, 11, 12]))


def test_a_token_budget_cuts_sorted_sequences_alike_on_every_rank():
    seqs = _seqs([(2, 2), (8, 6), (2, 3), (3, 2), (2, 2)])
    batcher = MicroBatcher(rows=64, token_budget=10, position_parts=2)
    shares = [batcher.micro_batches(seqs, list(range(5)), None, 0, dp=2, dp_rank=r) for r in (0, 1)]
    assert [[mb["index"] for mb in share] for share in shares] == [[[0, 4], [2]], [[3], [1]]]
    for share in shares:
        for mb in share:
            real = [i for i in mb["index"] if i >= 0]
            width = mb["tokens"].shape[1]
            assert width == batcher.padded_len(max(positions(seqs[i]) for i in real)) and width % 2 == 0
            assert len(real) == 1 or len(real) * width <= 10
