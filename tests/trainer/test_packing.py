"""Sequence packing (trainer.packing, trainer/megatron/packing.py): the packed layout, and through the Megatron ranks
the same per-token log-probs, loss and gradients as padded rows, for each loss aggregation and with MoE routing
replay; a packed sequence never sees another."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainer.batch import TrainBatch, TrainSequence
from trainer.config import MoEConfig, ParallelConfig, TrainerConfig, TrainerSpec
from trainer.megatron.packing import packed_groups, packed_micro_batch, unpack
from trainer.megatron.token_fields import positions


def _seqs(seed: int, n: int, longest: int = 12) -> list[TrainSequence]:
    rng = random.Random(seed)
    return [TrainSequence([rng.randrange(3, 120) for _ in range(rng.randrange(2, 8))],
                          [rng.randrange(3, 120) for _ in range(rng.randrange(1, longest))],
                          reward=float(k % 3 == 0), group=k // 2) for k in range(n)]


def test_first_fit_decreasing_groups_within_the_budget_and_alike_counts_on_every_rank():
    shares = [[(0, 5), (1, 9), (2, 3), (3, 12)], [(4, 4)]]
    groups = packed_groups(shares, budget=10)
    # rank 0: 12 alone (over the budget), 9 (3 and 5 do not fit beside it), then 5 + 3; rank 1 filled up
    assert groups == [[[3], [1], [0, 2]], [[4], [-1], [-1]]]


def test_a_packed_row_restarts_positions_and_maps_each_sequence_back_to_its_row():
    seqs = _seqs(0, 3)
    mb = packed_micro_batch(seqs, [True, True, True], position_parts=4)
    lengths = [positions(s) for s in seqs]
    total = sum(lengths)
    assert mb["tokens"].shape == (1, -(-total // 4) * 4)
    bounds = mb["cu_seqlens"].tolist()
    assert bounds[:4] == [0, lengths[0], lengths[0] + lengths[1], total]
    assert bounds[-1] == mb["tokens"].shape[1]  # the tensor-parallel pad is a segment of its own
    for r, s in enumerate(seqs):
        start = bounds[r]
        assert mb["position_ids"][0, start:start + lengths[r]].tolist() == list(range(lengths[r]))
        assert mb["labels"][0, start:start + lengths[r]].tolist() == (s.prompt_ids + s.completion_ids)[1:]
    # the log-probs of the packed row land in each sequence's row, where its mask is
    logp = torch.arange(mb["tokens"].shape[1], dtype=torch.float32).unsqueeze(0) + 1
    rows = unpack(logp, mb)
    assert rows.shape == mb["mask"].shape == (3, max(lengths))
    for r, s in enumerate(seqs):
        first = bounds[r] + len(s.prompt_ids) - 1
        c = len(s.completion_ids)
        assert rows[r, len(s.prompt_ids) - 1:len(s.prompt_ids) - 1 + c].tolist() == list(range(first + 1,
                                                                                              first + 1 + c))
        assert (rows[r, lengths[r]:] == 0).all()
        assert mb["mask"][r].sum() == c


# ---- through the ranks -----------------------------------------------------------------------------------------
def _group(rank_pool, model_dir, packed: bool | str, **trainer):
    """`packed` True: packed rows; "budget": rows cut by the same token budget, padded to their longest; False:
    3 rows per micro-batch."""
    from orchestrator.workers.trainer_group import TrainerGroup

    budget = (dict(packing=True, micro_batch_tokens=48) if packed is True else dict(micro_batch_tokens=48)
              if packed == "budget" else dict(micro_batch_size=3))
    return TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(**budget, **trainer)),
                        pool=rank_pool)


def _train_and_score(rank_pool, model_dir, packed: bool | str, seqs: list[TrainSequence], **trainer):
    group = _group(rank_pool, model_dir, packed, **trainer)
    try:
        batch = TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, reward=s.reward, group=s.group,
                                          routed_experts=s.routed_experts) for s in seqs])
        before = group.logprobs(batch)
        for s, lp in zip(batch.sequences, before):
            s.old_logprobs = lp
        stats = group.train_step(batch, lr=1e-2, updates=2, epochs=2, shuffle_seed=3)
        return before, stats, group.logprobs(batch)
    finally:
        group.shutdown()


def _assert_same_training(padded, packed, relative: bool = False):
    """`relative`: log-probs within 1e-6 of their size, not 1e-6 (an MoE's experts multiply other row counts packed
    than padded, where padding positions are routed too: the GEMMs round differently)."""
    (before_a, stats_a, after_a), (before_b, stats_b, after_b) = padded, packed
    flat = [[x for lp in lps for x in lp] for lps in (before_a, before_b, after_a, after_b)]
    assert max(abs(a - b) / (max(abs(a), 1.0) if relative else 1.0) for a, b in zip(flat[0], flat[1])) <= 1e-6
    for key in ("loss", "grad_norm", "sq_log_ratio", "clip_fraction_low", "clip_fraction_high"):
        if key in stats_a:
            assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-5, abs=1e-7), key
    moved = max(abs(a - b) for a, b in zip(flat[0], flat[2]))
    assert moved > 1e-2  # the steps moved the policy...
    # ...alike, to float rounding (4 Adam steps: its first divides by |g|, so rounding in small gradients grows)
    assert max(abs(a - b) for a, b in zip(flat[2], flat[3])) <= 1e-3 * moved


@pytest.mark.slow
@pytest.mark.parametrize("loss,agg", [("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"),
                                      ("grpo", "seq_mean_token_sum"), ("kimi", "token_mean")])
def test_packed_and_padded_micro_batches_train_alike(ray_cluster, rank_pool, tiny_model_dir, loss, agg):
    seqs = _seqs(1, 10)
    kw = dict(loss=loss) | (dict(loss_agg=agg) if loss == "grpo" else {})
    _assert_same_training(_train_and_score(rank_pool, tiny_model_dir, False, seqs, **kw),
                          _train_and_score(rank_pool, tiny_model_dir, True, seqs, **kw))


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="mixtral", hidden_size=32, intermediate_size=48, num_experts=4, init_std=0.3)
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", AdditionTask(1).corpus(), spec)


@pytest.mark.slow
def test_packed_and_padded_train_alike_with_moe_routing_replay(ray_cluster, rank_pool, tiny_moe_dir):
    """Replayed routing follows the tokens into the packed row: records that differ from what the router would
    choose (random experts) give the same log-probs and training packed or padded."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_moe_dir)
    rng = np.random.default_rng(0)
    seqs = _seqs(2, 8)
    for s in seqs:
        scores = rng.random((positions(s), cfg.num_hidden_layers, cfg.num_local_experts))
        s.routed_experts = np.argsort(scores, axis=-1)[..., :cfg.num_experts_per_tok].astype(np.int16)
    kw = dict(loss="grpo", moe=MoEConfig(routing_replay="rollout"))
    _assert_same_training(_train_and_score(rank_pool, tiny_moe_dir, False, seqs, **kw),
                          _train_and_score(rank_pool, tiny_moe_dir, True, seqs, **kw), relative=True)


@pytest.mark.slow
def test_a_packed_sequence_never_attends_to_the_others(ray_cluster, rank_pool, tiny_model_dir):
    """A sequence's log-probs packed beside others equal its log-probs alone (the others' tokens changed too), to
    float rounding: had attention crossed the boundary, the earlier sequences' tokens would move them."""
    from orchestrator.workers.trainer_group import TrainerGroup

    seqs = _seqs(3, 4, longest=20)
    others = _seqs(4, 4, longest=20)
    trainer = TrainerConfig(packing=True, micro_batch_tokens=4096)
    group = TrainerGroup(TrainerSpec(hf_dir=str(tiny_model_dir), trainer=trainer), pool=rank_pool)
    try:
        together = group.logprobs(TrainBatch(seqs))
        shuffled = group.logprobs(TrainBatch(others[:3] + [seqs[3]]))
        alone = group.logprobs(TrainBatch([seqs[3]]))
    finally:
        group.shutdown()
    assert max(abs(a - b) for a, b in zip(together[3], alone[0])) <= 1e-6
    assert max(abs(a - b) for a, b in zip(shuffled[3], alone[0])) <= 1e-6


@pytest.mark.slow
def test_a_pipeline_trains_packed_and_token_budget_micro_batches_as_fixed_rows(ray_cluster, rank_pool, tiny_model_dir):
    """Two pipeline stages: micro-batches of other shapes each (packed rows, rows cut by a token budget) pass
    between the stages with their shapes sent first (Megatron's variable_seq_lengths) and train as fixed rows do."""
    seqs = _seqs(5, 10)
    kw = dict(loss="grpo", parallel=ParallelConfig(pp=2))
    rows = _train_and_score(rank_pool, tiny_model_dir, False, seqs, **kw)
    _assert_same_training(rows, _train_and_score(rank_pool, tiny_model_dir, True, seqs, **kw))
    _assert_same_training(rows, _train_and_score(rank_pool, tiny_model_dir, "budget", seqs, **kw))


@pytest.mark.slow
def test_sequence_parallel_packs_to_a_tensor_parallel_multiple(ray_cluster, rank_pool, tiny_moe_dir):
    """An MoE under tensor parallelism runs sequence parallel: each packed row is padded to a multiple of the two
    ranks with a pad segment of its own, and trains as fixed rows do."""
    seqs = _seqs(9, 7)
    groups = packed_groups([[(i, positions(s)) for i, s in enumerate(seqs)]], budget=48)[0]
    assert any(sum(positions(seqs[i]) for i in g) % 2 for g in groups)  # a packed row needs its pad segment
    kw = dict(loss="grpo", parallel=ParallelConfig(tp=2))
    _assert_same_training(_train_and_score(rank_pool, tiny_moe_dir, False, seqs, **kw),
                          _train_and_score(rank_pool, tiny_moe_dir, True, seqs, **kw), relative=True)
