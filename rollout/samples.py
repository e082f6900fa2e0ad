"""Samples: the batch that flows rollout -> reward -> train. No torch/vLLM imports; pickles through Ray."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sample:
    prompt_index: int  # index of the prompt in this iteration's batch; samples of one prompt form a group
    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # rollout policy log-prob of each completion token
    text: str = ""
    answer: str = ""  # the task's reference answer (or a test spec) the verifier reads
    reward: float | None = 0.0  # None: no reward function applied (the sample is left out of training)
    finish_reason: str = ""
    # Mixture-of-experts models: the experts the rollout routed each token to, int16 [len(prompt_ids) +
    # len(completion_ids) - 1 positions, hidden layers, top_k]; -1 where nothing was routed (dense layers).
    # rollout/routing_capture.py records it, trainer.moe.routing_replay replays it.
    routed_experts: np.ndarray | None = None
    # Multi-turn trajectories (rollout/agent/): per completion token, 1 where the policy sampled it and 0 where
    # tide inserted it (tool results, environment replies; their `logprobs` are 0.0), and the policy version
    # that produced it (-1 for inserted tokens). None: a single turn, every token sampled by one version.
    loss_mask: list[int] | None = None
    versions: list[int] | None = None
    # Multi-turn trajectories: the messages after the prompt (the model's turns and what was inserted), for the
    # logs; `text` then holds the model's last turn, what scorers read
    conversation: list[dict] | None = None


@dataclass
class Samples:
    items: list[Sample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.items]

    def groups(self) -> dict[int, list[Sample]]:
        out: dict[int, list[Sample]] = {}
        for s in self.items:
            out.setdefault(s.prompt_index, []).append(s)
        return out
