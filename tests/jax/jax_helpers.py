"""Tiny JAX engine settings shared by the JAX tests (a module, not conftest: several conftest.py files
exist under tests/, and `from conftest import ...` gets whichever was imported last)."""
from __future__ import annotations

from trainer.jax.config import JaxConfig

# Tiny settings: a few seconds of compile, well under a second per chunk.
TINY = dict(env="CartPole-v1", num_envs=4, num_steps=16, updates_per_iteration=2, epochs=2, minibatches=2,
            hidden_sizes=[16, 16])


def tiny(**overrides) -> JaxConfig:
    return JaxConfig(**{**TINY, **overrides})

# Tiny SAC on Pendulum: 2 envs x 4 steps per update, 2 gradient steps, updates from the 3rd update on.
SAC_TINY = dict(algorithm="sac", env="Pendulum-v1", num_envs=2, num_steps=4, updates_per_iteration=4,
                hidden_sizes=[16, 16], activation="relu", lr=1e-3,
                sac=dict(buffer_size=64, batch_size=8, learning_starts=16, gradient_steps=2))
# Tiny IMPALA on CartPole, actors one update behind the learner.
IMPALA_TINY = dict(algorithm="impala", env="CartPole-v1", num_envs=4, num_steps=16, updates_per_iteration=2,
                   hidden_sizes=[16, 16], impala=dict(lag=1, minibatches=2))
