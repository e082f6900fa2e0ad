"""Sequence packing (THD): a micro-batch as one row of several sequences back to back, positions restarting at each,
attention confined to its own sequence (Megatron's PackedSeqParams with qkv_format "thd")."""
from __future__ import annotations

import torch


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
