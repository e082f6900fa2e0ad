"""Sequence packing (THD): a micro-batch as one row of several sequences back to back, positions restarting at each,
attention confined to its own sequence (Megatron's PackedSeqParams, qkv_format "thd"; the core attention of
trainer/megatron/attention.py attends within each). What peers call removing padding (veRL's use_remove_padding,
slime's and NeMo-RL's packing): a micro-batch costs its tokens, not rows x its longest.

The tokens are packed; the per-token fields the loss reads (mask, old/ref/behaviour log-probs, versions, advantages)
stay one row per sequence, and `unpack` maps the packed log-probs and entropies onto those rows (`packed_index`), so
every loss aggregation sees the same [sequences, positions] layout, and the same denominators, packed or not.
Routing records for replay are packed with the tokens (the routers see the packed row's positions)."""
from __future__ import annotations

import torch

from trainer.batch import TrainSequence
from trainer.megatron.token_fields import per_token_rows, positions


def packed_groups(shares: list[list[tuple[int, int]]], budget: int) -> list[list[list[int]]]:
    """Each data-parallel rank's share [(sequence index, positions)] cut into groups of at most `budget` positions
    (first-fit decreasing; a sequence longer than the budget alone), every rank filled up to the largest count with
    placeholder groups ([-1]): all ranks run the same number of micro-batches."""
    def cut(share: list[tuple[int, int]]) -> list[list[int]]:
        bins: list[tuple[int, list[int]]] = []
        for i, n in sorted(share, key=lambda x: (-x[1], x[0])):
            for k, (used, members) in enumerate(bins):
                if used + n <= budget:
                    bins[k] = (used + n, members + [i])
                    break
            else:
                bins.append((n, [i]))
        return [members for _, members in bins]

    groups = [cut(share) for share in shares]
    most = max((len(g) for g in groups), default=0)
    return [g + [[-1]] * (most - len(g)) for g in groups]


def packed_micro_batch(rows: list[TrainSequence], real: list[bool], position_parts: int) -> dict:
    """One packed row [1, T] of `rows` (T: their positions, padded to a multiple of `position_parts`, the
    tensor-parallel ranks sequence parallelism splits positions over, with a pad segment of its own), its sequence
    boundaries `cu_seqlens`, and the per-token fields one row per sequence with `packed_index` [sequences, widest]:
    each row position's place in the packed row (-1 beyond the sequence)."""
    lengths = [positions(s) for s in rows]
    total = sum(lengths)
    padded = -(-total // position_parts) * position_parts
    tokens, labels, position_ids = [], [], []
    for s in rows:
        full = s.prompt_ids + s.completion_ids
        tokens += full[:-1]
        labels += full[1:]
        position_ids += range(len(full) - 1)
    pad = padded - total
    tokens += [0] * pad
    labels += [0] * pad
    position_ids += range(pad)
    bounds = [0]
    for n in lengths + ([pad] if pad else []):
        bounds.append(bounds[-1] + n)
    width = max(lengths)
    index = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, (start, n) in enumerate(zip(bounds, lengths)):
        index[r, :n] = torch.arange(start, start + n)
    fields = per_token_rows(rows, real, width)
    routing = fields.pop("routing")
    if routing is not None:  # the routers see the packed row: [1, T, layers, top_k]
        packed = routing.new_full((1, padded, *routing.shape[2:]), -1)
        for r, (start, n) in enumerate(zip(bounds, lengths)):
            packed[0, start:start + n] = routing[r, :n]
        routing = packed
    return dict(tokens=torch.tensor([tokens], dtype=torch.long), labels=torch.tensor([labels], dtype=torch.long),
                position_ids=torch.tensor([position_ids], dtype=torch.long),
                cu_seqlens=torch.tensor(bounds, dtype=torch.int32), packed_index=index, routing=routing, **fields)


def unpack(values: torch.Tensor | None, mb: dict) -> torch.Tensor | None:
    """Per-position values of a packed row [1, T, ...] as [sequences, widest, ...] rows (0 beyond each sequence); a
    padded micro-batch's [b, s, ...] as they are. Differentiable."""
    index = mb.get("packed_index")
    if values is None or index is None:
        return values
    index = index.to(values.device)
    flat = values.reshape(values.shape[1], *values.shape[2:])
    inside = (index >= 0).reshape(*index.shape, *[1] * (values.dim() - 2))
    return torch.where(inside, flat[index.clamp(min=0)], flat.new_zeros(()))


def packed_seq_params(mb: dict, device: str):
    """Megatron's PackedSeqParams of a packed micro-batch (its `cu_seqlens`: the row's sequence boundaries), None
    for a padded one."""
    cu_seqlens = mb.get("cu_seqlens")
    if cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)
