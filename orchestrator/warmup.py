"""The optional supervised warm start (`trainer.warmup_sft_steps`): a few steps of negative log-likelihood on
the task's reference answers, so that RL starts from a policy that sometimes succeeds."""
from __future__ import annotations

from orchestrator.batches import text_batch
from orchestrator.trainer_group import TrainerGroup
from rollout.tasks import Task
from trainer.config import TrainerConfig


def warm_start(trainer: TrainerGroup, task: Task, tokenizer, cfg: TrainerConfig, seed: int) -> list[float]:
    """Returns the loss of every step."""
    n = cfg.warmup_sft_batch
    examples = task.sft_examples(seed, cfg.warmup_sft_steps * n)
    losses = [trainer.train_step(text_batch(tokenizer, examples[k * n:(k + 1) * n]), mode="sft",
                                 lr=cfg.warmup_sft_lr)["loss"]
              for k in range(cfg.warmup_sft_steps)]
    if cfg.warmup_sft_reset_optimizer:
        trainer.reset_optimizer()
    trainer.snapshot_reference()  # trainer.kl's reference is the policy RL starts from
    return losses
