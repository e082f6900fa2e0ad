"""The reward phase: the task's verifier scores every sample, then reward shaping (Kimi k1.5's length reward
when `trainer.length_penalty` > 0) is added; each sample's reward is set in place."""
from __future__ import annotations

import torch

from rollout.samples import Samples
from rollout.tasks import Problem, Task
from trainer.losses import length_reward


def score_samples(task: Task, problems: list[Problem], samples: Samples, length_penalty: float) -> dict[str, float]:
    correct = task.score([problems[s.prompt_index] for s in samples], [s.text for s in samples])
    rewards = torch.tensor(correct, dtype=torch.float32)
    if length_penalty > 0:
        lengths = torch.tensor([len(s.completion_ids) for s in samples])
        groups = torch.tensor([s.prompt_index for s in samples])
        rewards = rewards + length_penalty * length_reward(lengths, rewards > 0.5, groups)
    for s, r in zip(samples, rewards.tolist()):
        s.reward = r
    return {"reward_mean": float(rewards.mean()), "accuracy": sum(correct) / len(correct),
            "completion_len": sum(len(s.completion_ids) for s in samples) / len(samples)}
