"""Which trainer ranks a node holds when the trainer spans `placement.trainer_nodes` nodes, and how many bytes of
each iteration's published Hugging Face checkpoint its ranks write into that node's shared memory. Pure arithmetic
on trainer/memory_plan.py's ModelShape and TrainerLayout (`tide plan` reports it; no torch, no Megatron).

Ranks: world / nodes consecutive ranks per node (Ray's bundles in rank order), each rank's coordinates in
Megatron-core's default order tp-cp-ep-dp-pp, fastest first (megatron/core/parallel_state.py,
initialize_model_parallel's `order`; its expert RankGenerator: tp, ep, expert-dp, pp): so with pp = nodes each node
holds one pipeline stage, with pp 1 and dp = nodes one data-parallel replica.

Published bytes: every Hugging Face tensor is written once per iteration, by the ranks of one copy of it (its
tensor-parallel shards, one per tp rank). A tensor's candidate nodes are those holding a whole copy: its pipeline
stage (layers split evenly over stages, the embedding on the first, the final norm and output layer on the last;
tied embeddings only on the first), and for a routed expert its expert-parallel rank (experts split evenly over ep
ranks, as Megatron shards them). Where several nodes hold a copy (data-parallel replicas, or the dense weights
replicated over the ep ranks), writing is split between them balanced by bytes. The publish does that per HF
tensor over the replicas (ckpt_transfer/convert/common.py, replica_share: Graham's LPT rule, largest first to the
least loaded, within 4/3 of the best split; Graham 1969, "Bounds on multiprocessing timing anomalies"); the plan
applies the same rule over the candidate nodes to coarser units (a layer's attention, its norms, its dense MLP or
router + shared expert, each routed expert), so a node's figure may differ from the run's by about one unit."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer.memory_plan import DTYPE_BYTES, ModelShape, TrainerLayout


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp: int
    ep: int
    dp: int  # the expert-data-parallel rank: tide's trainer.parallel.dp replica (dense weights: dp x ep replicas)
    pp: int


@dataclass(frozen=True)
class PublishUnit:
    """A group of Hugging Face tensors written together: `stage` the pipeline stage holding it, `expert_rank` the
    expert-parallel rank of a routed expert (None: every ep rank holds it)."""

    what: str
    stage: int
    expert_rank: int | None
    bytes: int


@dataclass
class NodeShare:
    node: int
    ranks: list[RankCoords]
    published: int = 0  # bytes written into this node's shared memory per iteration
    units: list[str] = field(default_factory=list)

    def coordinates(self, axis: str) -> list[int]:
        return sorted({getattr(c, axis) for c in self.ranks})


def rank_coords(rank: int, layout: TrainerLayout) -> RankCoords:
    """Rank `rank`'s coordinates under Megatron's order tp-cp-ep-dp-pp (cp 1)."""
    tp, ep, dp = layout.tp, layout.ep, layout.dp
    return RankCoords(rank=rank, tp=rank % tp, ep=rank // tp % ep, dp=rank // (tp * ep) % dp,
                      pp=rank // (tp * ep * dp))


def node_ranks(layout: TrainerLayout, nodes: int) -> list[list[RankCoords]]:
    """The ranks of each node: world / nodes consecutive ones."""
    world = layout.dp * layout.tp * layout.pp * layout.ep
    if nodes < 1 or world % nodes:
        raise ValueError(f"{world} trainer ranks (dp x tp x pp x ep) do not split evenly over {nodes} nodes")
    per_node = world // nodes
    return [[rank_coords(r, layout) for r in range(n * per_node, (n + 1) * per_node)] for n in range(nodes)]


def layer_stage(layer: int, layers: int, pp: int) -> int:
    """Megatron's even split of the decoder layers over pipeline stages (no uneven first/last stage)."""
    return layer * pp // layers


def publish_units(shape: ModelShape, layout: TrainerLayout, dtype: str) -> list[PublishUnit]:
    """The published checkpoint as units: their bytes sum to shape.parameters() x the dtype's width. Dense layers
    come first (DeepSeek-V3's first_k_dense_replace; the other MoE families have experts in every layer)."""
    width, h, pp = DTYPE_BYTES[dtype], shape.hidden, layout.pp
    last = pp - 1
    units = [PublishUnit("embedding", 0, None, shape.vocab * h * width),
             PublishUnit("final norm", last, None, h * width)]
    if not shape.tied_embeddings:
        units.append(PublishUnit("output layer", last, None, shape.vocab * h * width))
    dense_layers = shape.layers - shape.moe_layers
    per_expert_rank = shape.experts // layout.ep if shape.experts else 0
    router = (h + 1 if shape.linear_bias else h) * shape.experts
    for i in range(shape.layers):
        stage = layer_stage(i, shape.layers, pp)
        units.append(PublishUnit(f"layer {i} attention", stage, None, shape.attention_parameters() * width))
        units.append(PublishUnit(f"layer {i} post-attention norm", stage, None, h * width))
        if i < dense_layers:
            units.append(PublishUnit(f"layer {i} mlp", stage, None, shape.mlp_parameters(shape.ffn) * width))
            continue
        shared = shape.mlp_parameters(shape.shared_ffn) if shape.shared_ffn else 0
        units.append(PublishUnit(f"layer {i} router", stage, None, (router + shared) * width))
        units.extend(PublishUnit(f"layer {i} expert {e}", stage, e // per_expert_rank,
                                 shape.mlp_parameters(shape.moe_ffn) * width) for e in range(shape.experts))
    return units


def node_shares(shape: ModelShape, layout: TrainerLayout, nodes: int, dtype: str) -> list[NodeShare]:
    """Each node's ranks and the bytes of the published checkpoint they write (module docstring)."""
    shares = [NodeShare(node=n, ranks=ranks) for n, ranks in enumerate(node_ranks(layout, nodes))]
    holders: dict[tuple[int, int | None], list[NodeShare]] = {}
    for share in shares:
        for stage in share.coordinates("pp"):
            for ep_rank in share.coordinates("ep"):
                # a whole copy: every tp shard of (stage, ep rank) on this node
                tps = {c.tp for c in share.ranks if c.pp == stage and c.ep == ep_rank}
                if len(tps) == layout.tp:
                    holders.setdefault((stage, ep_rank), []).append(share)
                    holders.setdefault((stage, None), [])
                    if share not in holders[(stage, None)]:
                        holders[(stage, None)].append(share)
    for unit in sorted(publish_units(shape, layout, dtype), key=lambda u: -u.bytes):
        candidates = holders.get((unit.stage, unit.expert_rank))
        if not candidates:
            raise ValueError(f"no node holds every tensor-parallel shard of {unit.what} (tp {layout.tp} spans "
                             f"nodes: {layout.dp * layout.tp * layout.pp * layout.ep // nodes} ranks per node)")
        writer = min(candidates, key=lambda s: (s.published, s.node))
        writer.published += unit.bytes
        writer.units.append(unit.what)
    return shares


def checkpoint_bytes(shape: ModelShape, dtype: str) -> int:
    return shape.parameters() * DTYPE_BYTES[dtype]


def shm_needed(published: int, keep_last: int) -> int:
    """A node's shared memory for its share: publish.keep_last iterations kept plus the one being written
    (ckpt_transfer/config.py, PublishConfig.shm_root)."""
    return math.ceil(published * (keep_last + 1))
