"""The optional supervised warm start (`trainer.warmup_sft_steps`): a few steps of negative log-likelihood on
the task's reference answers, so that RL starts from a policy that sometimes succeeds. Prompts are the rendered
token ids the engines will see; each completion ends as the policy should end it (orchestrator/prompts.py)."""
from __future__ import annotations

from orchestrator.config import ConfigError
from orchestrator.prompts import RenderedTask
from orchestrator.trainer_group import TrainerGroup
from trainer.batch import TrainBatch, TrainSequence
from trainer.config import TrainerConfig


def warm_start(trainer: TrainerGroup, task: RenderedTask, cfg: TrainerConfig, seed: int) -> list[float]:
    """Returns the loss of every step."""
    n = cfg.warmup_sft_batch
    pairs = task.sft_pairs(seed, cfg.warmup_sft_steps * n)
    if not pairs:
        raise ConfigError("trainer.warmup_sft_steps: every warm-start prompt is longer than "
                          "rollout.max_prompt_tokens")
    losses = []
    for k in range(cfg.warmup_sft_steps):
        chunk = pairs[k * n:(k + 1) * n] or pairs[:n]  # prompts skipped as overlong: steps reuse the first ones
        batch = TrainBatch([TrainSequence(list(p.prompt_ids), ids) for p, ids in chunk])
        losses.append(trainer.train_step(batch, mode="sft", lr=cfg.warmup_sft_lr)["loss"])
    if cfg.warmup_sft_reset_optimizer:
        trainer.reset_optimizer()
    trainer.snapshot_reference()  # trainer.kl's reference is the policy RL starts from
    return losses
