"""trainer.distributed_optimizer on gloo: Megatron's distributed optimizer (Adam's state sharded over the
data-parallel ranks) trains two data-parallel ranks as the plain optimizer does, and a checkpoint of it resumes
the run exactly; a checkpoint of the other optimizer is refused by name."""
from __future__ import annotations

import random

import pytest

from trainer.batch import TrainBatch, TrainSequence
from trainer.config import ParallelConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow


def _batch() -> TrainBatch:
    rng = random.Random(0)
    return TrainBatch([TrainSequence([rng.randrange(3, 120) for _ in range(5)],
                                     [rng.randrange(3, 120) for _ in range(n)], old_logprobs=[-4.0] * n,
                                     reward=float(k % 2), group=k // 2)
                       for k, n in enumerate([3, 7, 4, 9, 5, 6, 2, 8])])


def _group(rank_pool, model_dir, distributed: bool):
    from orchestrator.workers.trainer_group import TrainerGroup

    return TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(
        parallel=ParallelConfig(dp=2), micro_batch_size=2, distributed_optimizer=distributed)), pool=rank_pool)


def _losses(group, steps: int) -> list[float]:
    return [group.train_step(_batch(), lr=1e-2, updates=2)["loss"] for _ in range(steps)]


def test_distributed_optimizer_trains_and_resumes_as_the_plain_one(ray_cluster, rank_pool, tiny_model_dir,
                                                                     tmp_path):
    plain = _group(rank_pool, tiny_model_dir, distributed=False)
    try:
        expected = _losses(plain, 4)
        plain.save_checkpoint(str(tmp_path / "plain"))
    finally:
        plain.shutdown()
    sharded = _group(rank_pool, tiny_model_dir, distributed=True)
    try:
        losses = _losses(sharded, 3)
        assert losses == pytest.approx(expected[:3], rel=1e-5)
        assert losses[2] != pytest.approx(losses[0], rel=1e-3)  # the steps moved the policy
        sharded.save_checkpoint(str(tmp_path / "sharded"))
        digests = sharded.parameter_digests()
        assert _losses(sharded, 1) == pytest.approx(expected[3:], rel=1e-5)
        sharded.load_checkpoint(str(tmp_path / "sharded"))
        assert sharded.parameter_digests() == digests
        # Adam's moments and step count restored: the resumed step is the one taken before
        assert _losses(sharded, 1) == pytest.approx(expected[3:], rel=1e-6)
        with pytest.raises(Exception, match="resume with trainer.distributed_optimizer False"):
            sharded.load_checkpoint(str(tmp_path / "plain"))
    finally:
        sharded.shutdown()
