"""Training: Megatron-core ranks (`trainer.megatron`, imported on demand), RL losses, the messages a trainer
takes, the tiny-model builder, and the JAX engine (`trainer.jax`). Importing this package imports neither
Megatron nor JAX."""
from .batch import TrainBatch, TrainSequence
from .config import ParallelConfig, TrainerConfig, TrainerSpec
from .losses import LossSpec, advantages, length_reward, policy_loss

__all__ = ["TrainBatch", "TrainSequence", "TrainerConfig", "TrainerSpec", "ParallelConfig", "LossSpec",
           "advantages", "length_reward", "policy_loss"]
