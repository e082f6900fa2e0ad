"""The proof that the engines serve the trainer's weights and sample the distribution the trainer trains.

Every iteration: the trainer's log-probs of the first mini-batch, computed before its update for the loss
anyway, against the log-probs the engines returned for those tokens (slime compares the same two); the
engines sampled them on the weights the trainer still holds, so the mean absolute difference must stay
within `rollout.max_logprob_gap`. It is checked before the iteration publishes anything. A batch drawn ahead
(rollout.max_staleness 1) was sampled by the policy before the update that trains while it is drawn: the trainer
keeps a snapshot of that policy, and the batch is checked against it once drained (`behaviour_gap`: every
updates_per_iteration-th sample, as many as lockstep's first mini-batch), before the engines load the new weights.

The probe (`rollout.probe_every`): after a sync each engine samples one completion for each of a fixed set
of probe prompts, with the run's temperature / top-p / top-k and a fixed seed, and the trainer recomputes the
log-probs of those tokens under the same distribution; the worst engine's mean gap has the same bound. It
covers every engine by name, which the first mini-batch need not. With `agent:` the probe also plays fixed
multi-turn trajectories and compares the sampled tokens' log-probs, each turn sampled after inserted tokens."""
from __future__ import annotations

from dataclasses import replace

from orchestrator.iteration.batches import samples_batch
from orchestrator.config.schema import ConfigError
from orchestrator.workers.prompts import RenderedTask
from orchestrator.workers.rollout_group import RolloutGroup
from orchestrator.workers.trainer_group import TrainerGroup
from rollout.tasks import Problem
from trainer.batch import TokenDistribution

PROBE_STREAM = 10**9  # offset of the probe problems' seed from the run's (never drawn by training)
# what each probe metric measured, as a failed check names it
PROBE_BATCHES = {"probe_gap": "the probe batch", "probe_gap_agent": "the probe's multi-turn trajectories"}


class LogprobGapError(RuntimeError):
    pass


def probe_problems(task: RenderedTask, seed: int, n: int) -> list[Problem]:
    """Fixed prompts, the same every iteration, rendered as training's are."""
    problems = [replace(p, task_id="probe") for p, _ in task.sft_pairs(seed + PROBE_STREAM, n)]
    if not problems:
        raise ConfigError("rollout.max_prompt_tokens: every probe prompt is longer than it")
    return problems


def agent_probe_problems(task: RenderedTask, seed: int, n: int) -> list[Problem]:
    """The multi-turn probe's problems: the task's own (with the columns an environment starts from), from a
    stream training never draws."""
    return task.problems(seed + PROBE_STREAM, 0, n)


def logprob_gap(trainer: TrainerGroup, rollout: RolloutGroup, problems: list[Problem], max_new_tokens: int,
                sampling: TokenDistribution, seed: int) -> float:
    """Mean |engine - trainer| log-prob of the tokens each engine samples for `problems`, worst engine."""
    return max(sampled_gap(trainer, samples, sampling)
               for samples in rollout.generate_on_each(problems, max_new_tokens, sampling, seed + PROBE_STREAM))


def agent_logprob_gap(trainer: TrainerGroup, agent, rollout: RolloutGroup, problems: list[Problem],
                      sampling: TokenDistribution, seed: int) -> float:
    """With `agent:`, the same check on multi-turn trajectories of fixed problems: mean |engine - trainer|
    log-prob over the tokens the engines sampled, each turn continued from the tokens before it (the inserted
    ones included), as the trainer reads the whole trajectory at once."""
    from orchestrator.agents.agent_rollout import engine_turns

    samples = agent.rollout(engine_turns(rollout, sampling), problems, 1, seed + PROBE_STREAM, version=-1).samples
    return sampled_gap(trainer, samples, sampling)


def behaviour_gap(trainer: TrainerGroup, samples, sampling: TokenDistribution, share: int = 1) -> float:
    """A batch drawn ahead (rollout.max_staleness 1): mean |engine - trainer| log-prob over the trained tokens of
    every `share`-th sample, the trainer on its snapshot of the policy that sampled the batch
    (TrainerGroup.snapshot_behaviour). With share = updates_per_iteration it reads as many samples as lockstep's
    check of the first mini-batch, spread over every prompt: a forward of 1/share of the batch."""
    return sampled_gap(trainer, list(samples)[::share], sampling, behaviour=True)


def sampled_gap(trainer: TrainerGroup, samples, sampling: TokenDistribution, behaviour: bool = False) -> float:
    """Mean |engine - trainer| log-prob over the tokens the engines sampled (a trajectory's inserted tokens carry
    no behaviour log-prob), the trainer on its policy or (`behaviour`) its snapshot. Every sample counts, scored
    or not: a trajectory an agent's task scores after the rollout has no reward yet, and the check trains
    nothing."""
    batch = samples_batch(samples, sampling, unscored=True)
    ours = trainer.logprobs(batch, behaviour=behaviour)
    diffs = [abs(a - b) for x, seq in zip(ours, batch.sequences)
             for a, b, m in zip(x, seq.old_logprobs, seq.trained_mask) if m]  # old_logprobs: the engines'
    return sum(diffs) / max(len(diffs), 1)  # as lockstep's check of a mini-batch without trained tokens


def probe_due(interval: int, iteration: int) -> bool:
    return interval > 0 and iteration % interval == 0


def check_logprob_gap(iteration: int, gap: float, limit: float, where: str = "the probe batch",
                      origin: str | None = None) -> None:
    """`origin`: where the bound comes from and the run's dtype (RolloutConfig.logprob_gap_origin)."""
    if not gap <= limit:  # also catches NaN
        raise LogprobGapError(
            f"iteration {iteration}: vLLM and trainer log-probs differ by {gap:.3g} on {where} "
            f"({origin or f'rollout.max_logprob_gap = {limit:g}'}); the engines do not serve the trainer's "
            f"weights, or do not sample the distribution the trainer computes"
        )
