"""Issue 58 items 6-8 through the Megatron ranks (trainer/megatron/worker.py): the KL term's importance weight."""
from __future__ import annotations

import math
import random

import pytest

from trainer.batch import TrainBatch, TrainSequence
from trainer.config import KLConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow


def _sequences(seed: int, groups: int) -> list[TrainSequence]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for reward in (1.0, 0.0):
            prompt = [rng.randrange(3, 120) for _ in range(rng.randrange(3, 7))]
            completion = [rng.randrange(3, 120) for _ in range(rng.randrange(2, 6))]
            out.append(TrainSequence(prompt, completion, reward=reward, group=g))
    return out


def _copy(s: TrainSequence, **fields) -> TrainSequence:
    return TrainSequence(s.prompt_ids, s.completion_ids, **(dict(reward=s.reward, group=s.group) | fields))


def _group(rank_pool, model_dir, **trainer):
    from orchestrator.trainer_group import TrainerGroup

    return TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(loss="grpo", micro_batch_size=8,
                                                                                  **trainer)), pool=rank_pool)


def test_the_kl_term_is_weighed_by_pi_over_the_behaviour_policy(ray_cluster, rank_pool, tiny_model_dir):
    """Issue 58 item 8 in the train step: zero advantages (the surrogate is 0), a KL term against given reference
    log-probs. Tokens whose sampler gave them e^-0.4 less probability than the current policy weigh e^0.4 times as
    much in the loss, its gradient and kl_ref_mean (pi_theta / pi_behaviour; before, the same)."""
    group = _group(rank_pool, tiny_model_dir, kl=KLConfig(coef=0.5, estimator="k3"))
    try:
        seqs = [_copy(s, reward=1.0) for s in _sequences(2, 2)]
        ours = group.logprobs(TrainBatch(seqs))

        def batch(shift: float) -> TrainBatch:
            return TrainBatch([_copy(s, reward=1.0, old_logprobs=[x - shift for x in lp],
                                     ref_logprobs=[x - 0.3 for x in lp]) for s, lp in zip(seqs, ours)])

        on_policy, stale = group.train_step(batch(0.0), lr=0.0), group.train_step(batch(0.4), lr=0.0)
        assert on_policy["loss"] == pytest.approx(0.5 * (math.exp(-0.3) - 1 + 0.3), rel=1e-4)  # k3 of r = -0.3
        for key in ("loss", "grad_norm", "kl_ref", "kl_ref_mean"):
            assert stale[key] == pytest.approx(math.exp(0.4) * on_policy[key], rel=1e-4), key
    finally:
        group.shutdown()
