"""trainer/node_plan.py: each trainer node's ranks under Megatron's rank order (checked against megatron-core's own
RankGenerator) and its share of the published checkpoint: a pipeline stage's layers per node, data-parallel
replicas splitting the writing, expert ranks their experts; the shares sum to the checkpoint."""
from __future__ import annotations

import pytest

from trainer.memory_plan import ModelShape, TrainerLayout
from trainer.node_plan import checkpoint_bytes, node_ranks, node_shares, publish_units, rank_coords, shm_needed

# 4 layers, hidden 8, 2 heads; the MoE one has 8 experts of width 4 in every layer
DENSE = ModelShape(layers=4, hidden=8, ffn=16, heads=2, kv_heads=2, head_dim=4, vocab=32)
MOE = ModelShape(layers=4, hidden=8, ffn=16, heads=2, kv_heads=2, head_dim=4, vocab=32, experts=8, moe_layers=4,
                 moe_ffn=4, top_k=2)


def _layout(**parallel) -> TrainerLayout:
    return TrainerLayout(rows=1, seq_len=8, dtype="bfloat16", **parallel)


def _position(groups: list[list[int]], rank: int) -> int:
    return next(g.index(rank) for g in groups if rank in g)


@pytest.mark.parametrize("tp, ep, dp, pp", [(2, 2, 2, 2), (1, 4, 1, 2), (2, 1, 3, 2), (4, 2, 1, 1)])
def test_coordinates_follow_megatron_rank_generators(tp, ep, dp, pp):
    from megatron.core.parallel_state import RankGenerator

    # initialize_model_parallel's two generators: dense layers (dp x ep replicas), experts (tp, ep, expert-dp, pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp * ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    layout = _layout(tp=tp, ep=ep, dp=dp, pp=pp)
    for rank in range(tp * ep * dp * pp):
        c = rank_coords(rank, layout)
        assert c.tp == _position(dense.get_ranks("tp"), rank) == _position(expert.get_ranks("tp"), rank)
        assert c.pp == _position(dense.get_ranks("pp"), rank) == _position(expert.get_ranks("pp"), rank)
        assert c.ep == _position(expert.get_ranks("ep"), rank)
        assert c.dp == _position(expert.get_ranks("dp"), rank)


def test_units_sum_to_the_checkpoint():
    for shape in (DENSE, MOE, ModelShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=1, head_dim=4, vocab=32,
                                         tied_embeddings=True)):
        units = publish_units(shape, _layout(pp=2, ep=2), "bfloat16")
        assert sum(u.bytes for u in units) == checkpoint_bytes(shape, "bfloat16") == shape.parameters() * 2
        assert ("output layer" in {u.what for u in units}) is not shape.tied_embeddings


def test_a_pipeline_stage_per_node():
    shares = node_shares(DENSE, _layout(tp=2, pp=2), 2, "bfloat16")
    assert [s.coordinates("pp") for s in shares] == [[0], [1]]
    first, last = (set(s.units) for s in shares)
    assert {"embedding", "layer 0 attention", "layer 1 mlp"} <= first and not first & {"output layer", "final norm"}
    assert {"output layer", "final norm", "layer 2 attention", "layer 3 mlp"} <= last and "embedding" not in last
    assert sum(s.published for s in shares) == checkpoint_bytes(DENSE, "bfloat16")
    units = {u.what: u.bytes for u in publish_units(DENSE, _layout(pp=2), "bfloat16")}
    assert shares[0].published == sum(units[u] for u in first)


def test_data_parallel_replicas_on_two_nodes_split_the_writing_by_bytes():
    shares = node_shares(DENSE, _layout(tp=2, dp=2), 2, "bfloat16")
    assert [s.coordinates("dp") for s in shares] == [[0], [1]]
    total, largest = checkpoint_bytes(DENSE, "bfloat16"), max(u.bytes for u in publish_units(DENSE, _layout(),
                                                                                              "bfloat16"))
    assert sum(s.published for s in shares) == total
    assert abs(shares[0].published - shares[1].published) <= largest  # greedy: within one unit of even
    assert not set(shares[0].units) & set(shares[1].units)  # every tensor written once


def test_expert_ranks_on_different_nodes_write_their_own_experts():
    shares = node_shares(MOE, _layout(tp=2, ep=4), 2, "bfloat16")  # ep ranks 0-1 on node 0, 2-3 on node 1
    assert [s.coordinates("ep") for s in shares] == [[0, 1], [2, 3]]
    experts = [{u for u in s.units if " expert " in u} for s in shares]
    assert experts[0] == {f"layer {i} expert {e}" for i in range(4) for e in range(4)}
    assert experts[1] == {f"layer {i} expert {e}" for i in range(4) for e in range(4, 8)}
    assert sum(s.published for s in shares) == checkpoint_bytes(MOE, "bfloat16")
    # the dense weights, held on both nodes (replicated over the ep ranks), are split between them
    assert all(any("attention" in u for u in s.units) for s in shares)


def test_ranks_are_consecutive_per_node_and_tp_may_not_span_nodes():
    assert [[c.rank for c in ranks] for ranks in node_ranks(_layout(tp=2, pp=2), 2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="do not split evenly over 3 nodes"):
        node_ranks(_layout(tp=2, pp=2), 3)
    with pytest.raises(ValueError, match="no node holds every tensor-parallel shard"):
        node_shares(DENSE, _layout(tp=4), 2, "bfloat16")


def test_shared_memory_holds_the_kept_iterations_and_the_one_being_written():
    assert shm_needed(10, keep_last=2) == 30
