"""The optional supervised warm start (`trainer.warmup_sft_steps`): a few steps of negative log-likelihood on
the task's reference answers, so that RL starts from a policy that sometimes succeeds. Prompts are the rendered
token ids the engines will see; each completion ends as the policy should end it (orchestrator/workers/prompts.py)."""
from __future__ import annotations

from typing import Callable

from orchestrator.config.schema import ConfigError
from orchestrator.workers.prompts import RenderedTask
from orchestrator.workers.trainer_group import TrainerGroup
from trainer.batch import TrainBatch, TrainSequence
from trainer.config import TrainerConfig


WARMUP_STOP_WINDOW = 10  # steps whose mean loss trainer.warmup_sft_stop_loss bounds


def reached(losses: list[float], stop_loss: float | None) -> bool:
    """Whether a warm-up with these step losses so far is done by trainer.warmup_sft_stop_loss: the mean of the
    last WARMUP_STOP_WINDOW steps at most `stop_loss` (never before that many steps)."""
    if stop_loss is None or len(losses) < WARMUP_STOP_WINDOW:
        return False
    return sum(losses[-WARMUP_STOP_WINDOW:]) / WARMUP_STOP_WINDOW <= stop_loss


def written_conversations(task: RenderedTask, cfg: TrainerConfig, seed: int) -> list[list[dict]] | None:
    """The multi-turn demonstrations the warm start trains an agent on: the task's own (`sft_conversations`), or a
    dataset's column (task.demonstrations_field); None: the task writes none (its reference answers are trained
    on)."""
    write = getattr(task.task, "sft_conversations", None)
    return None if write is None else write(seed, cfg.warmup_sft_steps * cfg.warmup_sft_batch)


def check_demonstrations(task: RenderedTask, cfg: TrainerConfig, seed: int, agent=None) -> None:
    """At start-up, before engines or trainer: the demonstrations the warm start would train on call only the
    agent's tools, with arguments their signatures take (`Agent.check_demonstrations`; every row of a dataset's
    column, the drawn ones of a task's own), and a dataset's demonstrations have an agent to train; ConfigError."""
    if getattr(task.task, "demonstrations_field", None) and agent is None:
        raise ConfigError("task.demonstrations_field: written demonstrations are tool-call conversations and need "
                          "an `agent:` section with the tools they call; add one, or remove the field")
    if agent is None or cfg.warmup_sft_steps == 0:
        return
    rows = getattr(task.task, "demonstration_rows", None)
    if rows is not None:
        agent.check_demonstrations(rows())
        return
    own = written_conversations(task, cfg, seed) or []
    agent.check_demonstrations([(f"task.name {task.task.name}'s written demonstration {i}", c)
                                for i, c in enumerate(own, 1)])


def warm_start(trainer: TrainerGroup, task: RenderedTask, cfg: TrainerConfig, seed: int, agent=None,
               on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Returns the loss of every step taken (fewer than warmup_sft_steps when warmup_sft_stop_loss ends it early);
    `on_step(step, loss)` hears of each as it ends (1-based). With an `agent`
    (orchestrator/agents/agent_rollout.py) and a task that writes multi-turn demonstrations (`written_conversations`),
    those are trained on, laid out as the agent's rollouts lay out trajectories, the model's turns only."""
    n = cfg.warmup_sft_batch
    conversations = written_conversations(task, cfg, seed) if agent is not None else None
    if conversations is not None:
        sequences = agent.demonstrations(conversations, task.renderer.end_of_turn_ids())
    else:
        sequences = [TrainSequence(list(p.prompt_ids), ids) for p, ids in task.sft_pairs(seed, cfg.warmup_sft_steps * n)]
    if not sequences:
        raise ConfigError("trainer.warmup_sft_steps: every warm-start prompt is longer than "
                          "rollout.max_prompt_tokens")
    losses = []
    for k in range(cfg.warmup_sft_steps):
        chunk = sequences[k * n:(k + 1) * n] or sequences[:n]  # prompts skipped as overlong: steps reuse the first
        losses.append(trainer.train_step(TrainBatch(chunk), mode="sft", lr=cfg.warmup_sft_lr)["loss"])
        if on_step is not None:
            on_step(k + 1, losses[-1])
        if reached(losses, cfg.warmup_sft_stop_loss):
            break
    if cfg.warmup_sft_reset_optimizer:
        trainer.reset_optimizer()
    trainer.snapshot_reference()  # trainer.kl's reference is the policy RL starts from
    return losses
