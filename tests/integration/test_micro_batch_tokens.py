"""trainer.micro_batch_tokens: micro-batches cut by a budget of positions from length-sorted sequences, each
padded to its own longest, compute what micro_batch_size rows padded to the batch's longest compute: the same
log-probs, loss, gradient norm and updated policy (to float rounding), on two data-parallel ranks whose shares
cut into different numbers of micro-batches (placeholders fill the shorter)."""
from __future__ import annotations

import random

import pytest

from trainer.batch import TrainBatch, TrainSequence
from trainer.config import ParallelConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow


def _batch(seed: int) -> TrainBatch:
    """Two groups of four: mostly short completions and a long tail, with a reward that varies in each group."""
    rng = random.Random(seed)
    seqs = []
    for g in range(2):
        for k in range(4):
            prompt = [rng.randrange(3, 120) for _ in range(rng.randrange(3, 6))]
            n = rng.choice([2, 3, 4, 40]) if k else 60  # the longest is 60 tokens, most a few
            seqs.append(TrainSequence(prompt, [rng.randrange(3, 120) for _ in range(n)], reward=float(k % 2),
                                      group=g))
    return TrainBatch(seqs)


def _run(rank_pool, model_dir, **trainer) -> tuple[list, dict, dict, list]:
    from orchestrator.workers.trainer_group import TrainerGroup

    spec = TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(loss="grpo", parallel=ParallelConfig(dp=2),
                                                                   **trainer))
    group = TrainerGroup(spec, pool=rank_pool)
    try:
        batch = _batch(0)
        before = group.logprobs(batch)
        for s, lp in zip(batch.sequences, before):
            s.old_logprobs = [x - 0.01 for x in lp]  # off-policy by a little: the ratio is not 1
        still = group.train_step(batch, lr=0.0, updates=2)
        stepped = group.train_step(batch, lr=1e-2, updates=2)
        return before, still, stepped, group.logprobs(batch)
    finally:
        group.shutdown()


def test_token_budget_micro_batches_compute_what_fixed_rows_do(ray_cluster, rank_pool, tiny_model_dir):
    rows = _run(rank_pool, tiny_model_dir, micro_batch_size=2)
    budget = _run(rank_pool, tiny_model_dir, micro_batch_tokens=48)
    flat = [[a for x in lps for a in x] for lps in (rows[0], budget[0], rows[3], budget[3])]
    assert flat[1] == pytest.approx(flat[0], abs=1e-5)
    for key in ("loss", "grad_norm", "tokens", "sq_log_ratio", "clip_fraction_high"):
        assert budget[1][key] == pytest.approx(rows[1][key], rel=1e-4, abs=1e-7), key
        assert budget[2][key] == pytest.approx(rows[2][key], rel=1e-4, abs=1e-7), key
    assert rows[2]["optimizer_steps"] == budget[2]["optimizer_steps"] == 2
    assert max(abs(a - b) for a, b in zip(flat[2], flat[0])) > 1e-3  # the step moved the policy...
    assert flat[3] == pytest.approx(flat[2], abs=1e-4)  # ...alike
