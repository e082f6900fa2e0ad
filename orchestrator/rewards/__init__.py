"""Rewards: the user's reward functions and the built-in ones (`rewards:`, functions.py, built_in.py), and the
reward phase that scores an iteration's samples with them or with the task's verifier (phase.py)."""
from orchestrator.rewards.functions import (RewardFunctionError, RewardFunctions, RewardSpec, ScoredBatch,
                                            TrainerState)
from orchestrator.rewards.phase import RewardPhase, reward_phase

__all__ = ["RewardFunctionError", "RewardFunctions", "RewardPhase", "RewardSpec", "ScoredBatch", "TrainerState",
           "reward_phase"]
