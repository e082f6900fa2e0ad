"""Rewards: the user's reward functions and the built-in ones (`rewards:`, functions.py, built_in.py), and the
reward phase that scores an iteration's samples with them or with the task's verifier (phase.py).

The phase is imported from its own module, not from here: it needs torch, and the config's schema imports this
package (for `rewards:`), so every `tide` command would pay for torch's import (1.1 s of `tide config show`'s 1.5 s,
measured) before knowing whether it needs it."""
from orchestrator.rewards.functions import (RewardFunctionError, RewardFunctions, RewardSpec, ScoredBatch,
                                            TrainerState)

__all__ = ["RewardFunctionError", "RewardFunctions", "RewardSpec", "ScoredBatch", "TrainerState"]
