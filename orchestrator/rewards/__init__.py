"""Rewards: the user's reward functions and the built-in ones (`rewards:`, functions.py, built_in.py), the settings
of models served for the run (`models:`, served_config.py; the Ray actors serving them are a worker group,
orchestrator/workers/served_models.py, attached to the functions when the run starts them), each reward's
normalisation (normalize.py), and the reward phase that scores an iteration's samples with them or with the task's
verifier (phase.py).

The phase is imported from its own module, not from here: it needs torch, and the config's schema imports this
package (for `rewards:`), so every `tide` command would pay for torch's import (1.1 s of `tide config show`'s 1.5 s,
measured) before knowing whether it needs it."""
from orchestrator.rewards.functions import (RewardFunctionError, RewardFunctions, RewardSpec, ScoredBatch,
                                            TrainerState)
from orchestrator.rewards.normalize import normalized
from orchestrator.rewards.served_config import ServedModelConfig

__all__ = ["RewardFunctionError", "RewardFunctions", "RewardSpec", "ScoredBatch", "TrainerState", "normalized",
           "ServedModelConfig"]
