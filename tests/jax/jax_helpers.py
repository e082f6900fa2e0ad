"""Tiny JAX engine settings shared by the JAX tests (a module, not conftest: several conftest.py files
exist under tests/, and `from conftest import ...` gets whichever was imported last)."""
from __future__ import annotations

from trainer.jax.config import JaxConfig

# Tiny settings: a few seconds of compile, well under a second per chunk.
TINY = dict(env="CartPole-v1", num_envs=4, num_steps=16, updates_per_iteration=2, epochs=2, minibatches=2,
            hidden_sizes=[16, 16])


def tiny(**overrides) -> JaxConfig:
    return JaxConfig(**{**TINY, **overrides})
