"""Shared types of the Megatron <-> Hugging Face conversion."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

import torch

# A Megatron parameter of a decoder layer: (layer index, name within the layer)
LAYER_PARAM = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class RankLayout:
    """Where a trainer rank sits. `layer_map` maps a local decoder layer index to its global index (this
    removes pipeline parallelism); experts are renumbered with ep_rank/ep_size (removes expert parallelism)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    dp_rank: int = 0
    expert_dp_rank: int = 0
    layer_map: Mapping[int, int] | None = None  # None: local index == global index
    dp_size: int = 1
    expert_dp_size: int = 1

    @property
    def writes_dense(self) -> bool:
        """Data-parallel replicas hold the same dense weights: the conversion yields them on the first only
        (`replica_parts` asks every replica for them, to split the writing)."""
        return self.dp_rank == 0

    @property
    def writes_experts(self) -> bool:
        return self.expert_dp_rank == 0

    def replica_parts(self) -> tuple["RankLayout", "RankLayout"]:
        """Layouts converting only the dense tensors, and only the expert tensors, whatever this replica's index:
        what the replicas of one (tp, pp, ep) position hold alike, for `replica_share` to split."""
        return replace(self, dp_rank=0, expert_dp_rank=1), replace(self, dp_rank=1, expert_dp_rank=0)

    def global_layer(self, local: int) -> int:
        return local if self.layer_map is None else self.layer_map[local]


@dataclass
class HFTensor:
    """One element of the HF tensor stream: a tensor in Hugging Face naming and layout, possibly a shard along
    tp_dim (a TP shard, or an expert-parallel rank's block of stacked experts). tp_dim is None for tensors that are
    whole (replicated across TP ranks).

    `shape`, when set, is the HF shape and `tensor` a view holding the same elements in the same row-major
    order under another shape: q, k and v sliced out of Megatron's fused QKV are such views, so the writer
    copies them once, into the shard, instead of first into a contiguous tensor. `value()` materialises."""

    name: str
    tensor: torch.Tensor
    tp_rank: int = 0
    tp_size: int = 1
    tp_dim: int | None = None
    shape: tuple[int, ...] | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape) if self.shape is None else self.shape

    def value(self) -> torch.Tensor:
        """The tensor in its HF shape (a copy when `tensor` is a reshaping view)."""
        return self.tensor if self.shape is None else self.tensor.reshape(self.shape)


class ConversionError(ValueError):
    pass


def replica_share(stream: list[HFTensor], replica: int, replicas: int) -> list[HFTensor]:
    """Replica `replica`'s share of the tensors that `replicas` data-parallel replicas hold alike, so that they
    write one copy between them rather than one writing it all: the longest-processing-time rule (Graham 1969,
    "Bounds on multiprocessing timing anomalies") by element count, largest first, each to the replica with the
    fewest so far (ties: the lower index, then the name), within 4/3 of an even split. Every replica computes the
    same assignment from the same stream, so the shares are disjoint and cover it."""
    if replicas == 1:
        return stream
    loads = [0] * replicas
    mine = set()
    for t in sorted(stream, key=lambda t: (-t.tensor.numel(), t.name, t.tp_rank)):
        owner = min(range(replicas), key=lambda r: loads[r])
        loads[owner] += t.tensor.numel()
        if owner == replica:
            mine.add((t.name, t.tp_rank))
    return [t for t in stream if (t.name, t.tp_rank) in mine]


def decoder_kwargs(hf_config: Any) -> dict[str, Any]:
    """The TransformerConfig fields every supported family takes alike from its HF config: depth and widths,
    RMSNorm, and a gated MLP without biases; each family adds its attention's (and experts')."""
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        add_bias_linear=False,
    )


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @classmethod
    def from_hf(cls, cfg: Any) -> "AttentionShape":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cfg.hidden_size)


def tp_slice(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ConversionError(f"dimension {dim} of size {t.shape[dim]} is not divisible by TP={size}")
    return t.chunk(size, dim=dim)[rank].contiguous()


def split_qkv_views(qkv: torch.Tensor, att: AttentionShape, tp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_qkv without copies: q, k, v as views [groups, rows per group, ...] whose row-major order is that
    of HF's q_proj, k_proj, v_proj rows (reshape them to [groups * rows per group, ...])."""
    groups = att.num_kv_heads // tp_size
    q_per_group = att.num_heads // att.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (q_per_group + 2) * att.head_dim, *rest)
    q_rows = q_per_group * att.head_dim
    return (grouped[:, :q_rows], grouped[:, q_rows : q_rows + att.head_dim],
            grouped[:, q_rows + att.head_dim :])


def split_qkv(qkv: torch.Tensor, att: AttentionShape, tp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV (per query group: its query heads, then one key, then one value head) of one TP
    rank -> that rank's q, k, v rows. Works for weights [rows, hidden] and biases [rows]."""
    rest = qkv.shape[1:]
    q, k, v = (x.reshape(-1, *rest).contiguous() for x in split_qkv_views(qkv, att, tp_size))
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, att: AttentionShape, tp_size: int) -> torch.Tensor:
    """Inverse of split_qkv for one TP rank's q, k, v rows."""
    groups = att.num_kv_heads // tp_size
    q_per_group = att.num_heads // att.num_kv_heads
    rest = q.shape[1:]
    qg = q.reshape(groups, q_per_group, att.head_dim, *rest)
    kg = k.reshape(groups, 1, att.head_dim, *rest)
    vg = v.reshape(groups, 1, att.head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


TensorGetter = Callable[[str], torch.Tensor]
HFStream = Iterator[HFTensor]
