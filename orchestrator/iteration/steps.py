"""The iteration's steps between its batch and its weights: scoring the batch, laying it out for the trainer
(with the trainer's pi_old or the reference model's log-probs where the loss needs them) and the train step."""
from __future__ import annotations

from orchestrator.iteration.batches import attach_reference_logprobs, samples_batch
from orchestrator.iteration.drawing import sampling_seed
from orchestrator.iteration.learning_signal import SignalWatch
from orchestrator.iteration.mismatch import use_trainer_old_logprobs
from orchestrator.iteration.schedule import Drawn
from orchestrator.iteration.session import Session, console
from orchestrator.agents import episode_rewards
from orchestrator.rewards import TrainerState
from orchestrator.rewards.phase import RewardPhase, reward_phase
from trainer.batch import LoglinearProximal, TrainBatch
from trainer.lr_schedule import lr_at


def score(s: Session, iteration: int, drawn: Drawn) -> RewardPhase:
    """The batch's rewards: the reward functions' or the task's verifier's, or (an agent's environment that
    scores its own episodes) the episodes'."""
    if s.agent and s.agent.scores_itself:
        return episode_rewards(drawn.rolled.samples)
    t = s.cfg.trainer
    steps = t.updates_per_iteration * t.epochs  # what TRL's trainer_state counts: optimizer steps
    return reward_phase(s.task, drawn.problems, drawn.rolled.samples, t.length_penalty, s.reward_functions,
                        trainer_state=TrainerState((iteration - 1) * steps, s.cfg.iterations * steps))


def watch_signal(s: Session, signal: SignalWatch, iteration: int, drawn: Drawn, scored: RewardPhase) -> None:
    """Warn (console and status.json) when no prompt's samples have had a reward spread for a while, and when
    they have again."""
    if signal.observe(iteration, drawn.problems, drawn.rolled.samples, scored.values):
        s.run.set_status(warning=signal.warning)
        console.log(f"[yellow]{signal.warning or f'iteration {iteration}: the rewards spread again'}")


def train_batch(s: Session, iteration: int, drawn: Drawn) -> tuple[TrainBatch, dict[str, float]]:
    """The scored batch as the trainer takes it, and the mismatch correction's metrics: with a correction, the
    trainer's pi_old (phase old_logprobs; with `proximal: loglinear` interpolated per token in the train step
    instead), and with a KL term the reference model's log-probs (phase reference)."""
    r, run = s.cfg.rollout, s.run
    drawn.mask_beyond(r.max_staleness)  # none by schedule: a guard
    loglinear = s.mismatch_correction and r.proximal == "loglinear"  # pi_old interpolated in the train step
    batch = samples_batch(drawn.rolled.samples, s.sampling, version=drawn.version if loglinear else None)
    mismatch = {}
    if loglinear:
        batch.proximal = LoglinearProximal(trained_by=iteration - 1, tis_cap=r.tis_cap)
    elif s.mismatch_correction:
        with run.phase(iteration, "old_logprobs"):
            mismatch = use_trainer_old_logprobs(batch, s.trainer.logprobs(batch), s.mismatch_correction)
    if s.cfg.trainer.kl.coef > 0:
        with run.phase(iteration, "reference"):
            attach_reference_logprobs(batch, s.trainer.logprobs(batch, reference=True))
    return batch, mismatch


def train(s: Session, iteration: int, batch: TrainBatch) -> dict:
    """One iteration's updates on the batch, at the schedule's learning rate."""
    cfg, t = s.cfg, s.cfg.trainer
    shuffle = sampling_seed(cfg.seed, iteration) if t.shuffle_minibatches else None
    return s.trainer.train_step(batch, lr=lr_at(t.lr, t.lr_schedule, iteration, cfg.iterations),
                                updates=t.updates_per_iteration, shuffle_seed=shuffle, epochs=t.epochs)
