"""A user-written environment plugged in through `env: "toy_env:make"` (the `Environment` protocol):
a 1-D walk where action 1 moves right; reaching +3 ends the episode with reward 1."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.jax.envs import Discrete


class Walk:
    observation_shape = (1,)
    action_space = Discrete(2)

    def reset(self, key):
        pos = jax.random.randint(key, (), -1, 2).astype(jnp.float32)
        return pos[None], (pos, jnp.zeros((), jnp.int32))

    def step(self, key, state, action):
        pos, t = state
        pos = pos + jnp.where(action == 1, 1.0, -1.0)
        t = t + 1
        terminated = pos >= 3
        return pos[None], (pos, t), terminated.astype(jnp.float32), terminated, t >= 20


def make() -> Walk:
    return Walk()
