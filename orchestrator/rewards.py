"""The reward phase: every sample is scored by the task's verifier, or by the configured reward functions
(`rewards:`, orchestrator/reward_functions.py, where `length` is Kimi k1.5's length reward); with the task's
verifier, `trainer.length_penalty` > 0 adds the same length reward; each sample's reward is set in place. A sample every reward function
skips (None) keeps reward None and is left out of training."""
from __future__ import annotations

import torch

from orchestrator.reward_functions import RewardFunctions
from rollout.samples import Samples
from rollout.tasks import Problem, Task
from trainer.losses import length_reward


def score_samples(task: Task, problems: list[Problem], samples: Samples, length_penalty: float,
                  functions: RewardFunctions | None = None) -> dict[str, float]:
    asked = [problems[s.prompt_index] for s in samples]
    texts = [s.text for s in samples]
    if functions is None:
        values: list[float | None] = list(task.score(asked, texts))
        extra = {"accuracy": sum(values) / len(values)}
    else:
        columns = {"answer": [p.answer for p in asked],
                   **{k: [p.columns.get(k) for p in asked] for k in sorted({k for p in asked for k in p.columns})}}
        scored = functions.score([list(p.messages) if p.messages else p.prompt for p in asked], texts, columns,
                                 [len(s.completion_ids) for s in samples], [s.prompt_index for s in samples])
        values, extra = scored.rewards, {**scored.per_function, "excluded": sum(v is None for v in scored.rewards)}
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
    return {"reward_mean": float(rewards.mean()) if kept else float("nan"), **extra,
            "completion_len": sum(len(s.completion_ids) for s in samples) / len(samples)}
