"""The trainer applies the driver's mismatch correction as given (orchestrator/iteration/mismatch.py): each token's
policy gradient scaled by its importance weight, and a sequence the correction left out counts nowhere: the loss and
gradient of a batch with it equal those of the batch without it, in every normaliser."""
from __future__ import annotations

import math
import random

import pytest

from orchestrator.iteration.mismatch import MismatchCorrection, use_trainer_old_logprobs
from trainer.batch import TrainBatch, TrainSequence
from trainer.config import TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow


def _sequences(rng: random.Random, groups: list[int]) -> list[TrainSequence]:
    out = []
    for g in groups:
        for reward in (1.0, 0.0):
            prompt = [rng.randrange(3, 120) for _ in range(rng.randrange(3, 7))]
            completion = [rng.randrange(3, 120) for _ in range(rng.randrange(2, 6))]
            out.append(TrainSequence(prompt, completion, reward=reward, group=g))
    return out


def _corrected(trainer, seqs: list[TrainSequence], shift: dict[int, float], correction: MismatchCorrection
               ) -> tuple[TrainBatch, dict]:
    """The batch as the engines would have sampled it with log-probs below the trainer's by `shift` per token
    (per group), then corrected."""
    batch = TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, reward=s.reward, group=s.group) for s in seqs])
    ours = trainer.logprobs(batch)
    for s, lp in zip(batch.sequences, ours):
        s.old_logprobs = [x - shift[s.group] for x in lp]
    return batch, use_trainer_old_logprobs(batch, ours, correction)


def test_weights_scale_the_gradient_and_left_out_sequences_count_nowhere(ray_cluster, rank_pool, tiny_model_dir):
    from orchestrator.workers.trainer_group import TrainerGroup

    spec = TrainerSpec(hf_dir=str(tiny_model_dir), trainer=TrainerConfig(loss="grpo", loss_agg="seq_mean_token_mean",
                                                                          micro_batch_size=8))
    trainer = TrainerGroup(spec, pool=rank_pool)
    try:
        rng = random.Random(0)
        kept, far = _sequences(rng, [0, 1]), _sequences(rng, [2])
        # per token the engines' log-prob 0.05 below the trainer's (rho_t = e^0.05: a sequence's product stays
        # under 2), or 0.5 below for group 2 (its sequences' products, e^1 to e^2.5, exceed 2)
        shift = {0: 0.05, 1: 0.05, 2: 0.5}
        mis = MismatchCorrection("mis", mis_threshold=2.0)
        with_far, metrics = _corrected(trainer, kept + far, shift, mis)
        assert metrics["is_masked_seq_frac"] == pytest.approx(2 / 6)
        assert all(s.trained_tokens == 0 for s in with_far.sequences[4:])
        without, _ = _corrected(trainer, kept, shift, mis)
        lr0 = dict(mode="rl", lr=0.0)  # no step moves the weights: every call sees the same policy
        a, b = trainer.train_step(with_far, **lr0), trainer.train_step(without, **lr0)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-4)
        assert a["tokens"] == b["tokens"]
        # not a loss that is 0 either way: counted among the sequences, the left-out two would scale it by 4/6
        assert abs(b["loss"]) > 1e-2 and b["grad_norm"] > 1e-3
        # on the current policy (ratio 1, no clipping) the clipped surrogate is -A w_t per token: doubling every
        # weight doubles the loss and its gradient
        for s in without.sequences:
            s.is_weights = [2 * w for w in s.is_weights]
        doubled = trainer.train_step(without, **lr0)
        assert doubled["loss"] == pytest.approx(2 * b["loss"], rel=1e-5)
        assert doubled["grad_norm"] == pytest.approx(2 * b["grad_norm"], rel=1e-4)
    finally:
        trainer.shutdown()


def test_the_behaviour_snapshot_keeps_the_policy_that_sampled(ray_cluster, rank_pool, tiny_model_dir):
    """rollout.max_staleness 1: the batch drawn while a step trains is checked against the policy before that
    step, which the trainer keeps (snapshot_behaviour); its log-probs are that policy's exactly, after the update
    too, and a new snapshot takes the updated policy."""
    from orchestrator.workers.trainer_group import TrainerGroup

    spec = TrainerSpec(hf_dir=str(tiny_model_dir), trainer=TrainerConfig(loss="grpo", micro_batch_size=8))
    trainer = TrainerGroup(spec, pool=rank_pool)
    try:
        seqs = _sequences(random.Random(1), [0, 1])
        batch = TrainBatch(seqs)
        with pytest.raises(Exception, match="no behaviour snapshot"):
            trainer.logprobs(batch, behaviour=True)
        before = trainer.logprobs(batch)
        trainer.snapshot_behaviour()
        for s, lp in zip(seqs, before):
            s.old_logprobs = lp
        trainer.train_step(batch, mode="rl", lr=1e-2)
        after = trainer.logprobs(batch)
        moved = max(abs(a - b) for x, y in zip(after, before) for a, b in zip(x, y))
        assert moved > 1e-3
        assert trainer.logprobs(batch, behaviour=True) == before
        trainer.snapshot_behaviour()
        assert trainer.logprobs(batch, behaviour=True) == after
    finally:
        trainer.shutdown()


def test_loglinear_proximal_is_exact_on_the_first_mini_batch_and_interpolates_after(ray_cluster, rank_pool,
                                                                                      tiny_model_dir):
    """rollout.proximal loglinear, in the train step: with one mini-batch its pi_old is the recomputed one (the
    loss and gradient of tis on the recomputed pi_old); on a second mini-batch, one optimizer step after pi_old,
    each token's pi_old is log pi_b + d / (d + 1) (log pi_theta - log pi_b), d = 1 iteration x 2 steps, which the
    importance weights the step reports show (lr 0 keeps pi_theta where pi_old was)."""
    from orchestrator.workers.trainer_group import TrainerGroup
    from trainer.batch import LoglinearProximal

    spec = TrainerSpec(hf_dir=str(tiny_model_dir), trainer=TrainerConfig(loss="grpo", micro_batch_size=8))
    trainer = TrainerGroup(spec, pool=rank_pool)
    try:
        seqs = _sequences(random.Random(2), [0, 1])
        # the engines' log-probs 1 below the trainer's: rho = e, truncated to 2 on pi_old itself
        recomputed, metrics = _corrected(trainer, seqs, {0: 1.0, 1: 1.0}, MismatchCorrection("tis", tis_cap=2.0))
        loglinear = TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, old_logprobs=s.rollout_logprobs,
                                              reward=s.reward, group=s.group, versions=[0] * len(s.completion_ids))
                                for s in recomputed.sequences],
                               proximal=LoglinearProximal(trained_by=1, tis_cap=2.0))
        lr0 = dict(mode="rl", lr=0.0)
        a, b = trainer.train_step(recomputed, **lr0), trainer.train_step(loglinear, **lr0)
        assert abs(a["loss"]) > 1e-2
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert metrics["is_weight_mean"] == pytest.approx(2.0) and b["is_weight_mean"] == pytest.approx(2.0)
        assert b["is_truncated_frac"] == 1.0
        two = trainer.train_step(loglinear, updates=2, **lr0)  # sequences 0-1, then 2-3
        assert two["optimizer_steps"] == 2
        first, second = (sum(len(s.completion_ids) for s in seqs[:2]), sum(len(s.completion_ids) for s in seqs[2:]))
        assert two["is_weight_mean"] == pytest.approx((2.0 * first + math.exp(2 / 3) * second) / (first + second),
                                                      rel=1e-5)
        assert two["is_truncated_frac"] == pytest.approx(first / (first + second))
    finally:
        trainer.shutdown()
