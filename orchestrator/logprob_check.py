"""The proof that the engines serve the trainer's weights: after every sync, the trainer and every engine
score the same fixed (prompt, reference completion) pairs teacher-forced, and their mean absolute log-prob
difference must stay within `rollout.max_logprob_gap`."""
from __future__ import annotations

from orchestrator.batches import text_batch
from orchestrator.rollout_group import RolloutGroup
from orchestrator.trainer_group import TrainerGroup
from rollout.tasks import Task
from trainer.batch import TrainBatch

PROBE_STREAM = 10**9  # offset of the probe problems' seed from the run's (never drawn by training)


class LogprobGapError(RuntimeError):
    pass


def probe_batch(task: Task, tokenizer, seed: int, n: int) -> TrainBatch:
    """Fixed (prompt, reference completion) pairs, the same every iteration."""
    return text_batch(tokenizer, task.sft_examples(seed + PROBE_STREAM, n))


def logprob_gap(trainer: TrainerGroup, rollout: RolloutGroup, batch: TrainBatch) -> float:
    """Mean |engine - trainer| teacher-forced log-prob over the batch, for the worst engine."""
    ours = trainer.logprobs(batch)
    per_engine = rollout.score_sequences([s.prompt_ids for s in batch.sequences],
                                         [s.completion_ids for s in batch.sequences])
    gaps = []
    for theirs in per_engine:
        diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
        gaps.append(sum(diffs) / len(diffs))
    return max(gaps)


def check_logprob_gap(iteration: int, gap: float, limit: float) -> None:
    if not gap <= limit:  # also catches NaN
        raise LogprobGapError(
            f"iteration {iteration}: vLLM and trainer log-probs differ by {gap:.3g} on the probe batch "
            f"(rollout.max_logprob_gap = {limit:g}); the weights the engines serve are not the trainer's"
        )
