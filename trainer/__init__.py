"""Training: Megatron-core ranks (`trainer.megatron`, imported on demand), RL losses, the messages a trainer
takes, the tiny-model builder, and the JAX engine (`trainer.jax`). Importing this package imports neither
Megatron, JAX nor torch (the losses are imported on first use)."""
from .batch import TrainBatch, TrainSequence
from .config import ParallelConfig, TrainerConfig, TrainerSpec
from .loss_spec import LossSpec

_TORCH = {"advantages", "length_reward", "policy_loss"}  # imported on first use: importing torch takes seconds


def __getattr__(name: str):
    if name in _TORCH:
        from . import losses

        return getattr(losses, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


__all__ = ["TrainBatch", "TrainSequence", "TrainerConfig", "TrainerSpec", "ParallelConfig", "LossSpec",
           "advantages", "length_reward", "policy_loss"]
