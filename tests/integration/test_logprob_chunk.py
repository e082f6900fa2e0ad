"""trainer.logprob_chunk under tensor parallelism (TP 2, the vocabulary split over the ranks): log-probs computed
from the final hidden states by chunks of positions equal those of the whole micro-batch's logits, tempered
(vocab-parallel cross entropy and entropy, no gather) and truncated (the vocabulary gathered), and a train step
with an entropy bonus gives the same loss, entropy, gradient norm and updated policy; on a dense model (the output
layer's input all-reduces its gradient) and an MoE (sequence parallel: its input is all-gathered over positions)."""
from __future__ import annotations

import random

import pytest

from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
from trainer.config import ParallelConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow

TEMPERED = TokenDistribution(temperature=0.7)
TRUNCATED = TokenDistribution(temperature=0.7, top_k=40, top_p=0.9)


def _batch(dist: TokenDistribution) -> TrainBatch:
    rng = random.Random(0)
    return TrainBatch([TrainSequence([rng.randrange(3, 120) for _ in range(5)],
                                     [rng.randrange(3, 120) for _ in range(n)], old_logprobs=[-4.0] * n,
                                     reward=float(k % 2), group=k // 2)
                       for k, n in enumerate([3, 7, 4, 9])], distribution=dist)


@pytest.fixture(scope="module", params=["qwen2", "mixtral"])
def tp2_model_dir(request, tmp_path_factory):
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family=request.param, hidden_size=64, num_heads=4, num_kv_heads=2)
    return build_tiny_model(tmp_path_factory.mktemp(request.param) / "model", AdditionTask(1).corpus(), spec)


def _run(rank_pool, model_dir, chunk: int | None) -> tuple[list, list, dict, list]:
    from orchestrator.workers.trainer_group import TrainerGroup

    group = TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(
        parallel=ParallelConfig(tp=2), micro_batch_size=2, entropy_coef=0.01, logprob_chunk=chunk)), pool=rank_pool)
    try:
        tempered, truncated = group.logprobs(_batch(TEMPERED)), group.logprobs(_batch(TRUNCATED))
        stats = group.train_step(_batch(TEMPERED), lr=1e-2)
        return tempered, truncated, stats, group.logprobs(_batch(TEMPERED))
    finally:
        group.shutdown()


def test_chunked_logprobs_under_tensor_parallelism(ray_cluster, rank_pool, tp2_model_dir):
    whole = _run(rank_pool, tp2_model_dir, None)
    chunked = _run(rank_pool, tp2_model_dir, 5)
    for k in (0, 1, 3):
        flat = [[x for row in lps for x in row] for lps in (whole[k], chunked[k])]
        assert flat[1] == pytest.approx(flat[0], rel=1e-6, abs=1e-6), k
    for key in ("loss", "entropy", "logp_mean", "grad_norm"):
        assert chunked[2][key] == pytest.approx(whole[2][key], rel=1e-5, abs=1e-7), key
    before, after = ([x for row in lps for x in row] for lps in (whole[0], whole[3]))
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3  # the step moved the policy
