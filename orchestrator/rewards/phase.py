"""The reward phase: every sample is scored by the task's verifier, or by the configured reward functions
(`rewards:`, orchestrator/rewards/functions.py, where `length` is Kimi k1.5's length reward); with the task's
verifier, `trainer.length_penalty` > 0 adds the same length reward; each sample's reward is set in place. A sample
every reward function skips (None) keeps reward None and is left out of training.

Reward functions get what TRL gives them: a dataset row's columns under their own names but the prompt's (the
answer column too), other tasks' problems `answer` and their columns; chat prompts as the dataset's messages
(without `model.system_prompt`, which the renderer adds), plain prompts as their text."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator.rewards.functions import RewardBatch, RewardFunctions, TrainerState
from rollout.samples import Samples
from rollout.tasks import Problem, Task
from rollout.tasks.dataset import MISSING, field_value
from trainer.losses import length_reward


@dataclass
class RewardPhase:
    metrics: dict[str, float]
    extra_columns: dict[str, list] = field(default_factory=dict)  # logged by reward functions, one value per sample
    # what scored each sample, by the name a person knows it by: "reward 'label'" for each reward function, or the
    # task's verifier (orchestrator/iteration/learning_signal.py names the constant ones)
    values: dict[str, list] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)  # where the phase's time went (served models' seconds)


def reward_columns(problem: Problem) -> dict[str, Any]:
    """A problem's columns as reward functions get them (what `RewardFunctions(columns=...)` checks at start-up)."""
    if problem.answer_field is not None:
        return dict(problem.columns)
    return {"answer": problem.answer, **problem.columns}


def reference_answer(problem: Problem) -> Any:
    """The built-ins' `answer` and veRL's `ground_truth`: the value at a dataset's `answer_field` as the row holds
    it (veRL passes `reward_model.ground_truth` unconverted), else the problem's answer."""
    if problem.answer_field is not None:
        value = field_value(problem.columns, problem.answer_field)
        if value is not MISSING:
            return value
    return problem.answer


def reward_batch(problems: list[Problem], samples: Samples, trainer_state: TrainerState | None = None) -> RewardBatch:
    asked = [problems[s.prompt_index] for s in samples]
    per_problem = [reward_columns(p) for p in asked]
    names = sorted({k for columns in per_problem for k in columns})
    return RewardBatch(prompts=[list(p.messages) if p.messages else p.prompt for p in asked],
                       completions=[s.text for s in samples],
                       columns={k: [columns.get(k) for columns in per_problem] for k in names},
                       answers=[reference_answer(p) for p in asked],
                       completion_ids=[list(s.completion_ids) for s in samples],
                       groups=[s.prompt_index for s in samples], trainer_state=trainer_state)


def reward_phase(task: Task, problems: list[Problem], samples: Samples, length_penalty: float,
                 functions: RewardFunctions | None = None, *,
                 trainer_state: TrainerState | None = None) -> RewardPhase:
    """`trainer_state`: the progress a TRL-style function sees (None: zeros)."""
    extra_columns: dict[str, list] = {}
    parts: dict[str, float] = {}
    if functions is None:
        values: list[float | None] = list(task.score([problems[s.prompt_index] for s in samples],
                                                     [s.text for s in samples]))
        extra: dict[str, float | int] = {"accuracy": sum(values) / len(values)}
        by_scorer = {f"the {task.name} task's verifier": list(values)}
    else:
        scored = functions.score_batch(reward_batch(problems, samples, trainer_state))
        values, extra_columns, parts = scored.rewards, scored.extra_columns, scored.parts
        extra = {**scored.per_function, "excluded": sum(v is None for v in scored.rewards)}
        by_scorer = {f"reward {label!r}": vs for label, vs in scored.values.items()}
    kept = [i for i, v in enumerate(values) if v is not None]
    rewards = torch.tensor([values[i] for i in kept], dtype=torch.float32)
    if length_penalty > 0 and kept:
        lengths = torch.tensor([len(samples.items[i].completion_ids) for i in kept])
        groups = torch.tensor([samples.items[i].prompt_index for i in kept])
        rewards = rewards + length_penalty * length_reward(lengths, rewards > 0.5, groups)
    for s in samples:
        s.reward = None
    for i, r in zip(kept, rewards.tolist()):
        samples.items[i].reward = r
    metrics = {"reward_mean": float(rewards.mean()) if kept else float("nan"), **extra}
    return RewardPhase(metrics, extra_columns, by_scorer, parts)
