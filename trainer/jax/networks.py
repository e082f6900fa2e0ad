"""Flax MLP actor-critic: separate actor and critic torsos (PPO's usual choice), orthogonal init."""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainer.jax.distributions import Categorical, DiagNormal


def _activation(name: str):
    return nn.tanh if name == "tanh" else nn.relu


class ActorCritic(nn.Module):
    action_dim: int
    discrete: bool
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"
    obs_rank: int = 1  # trailing observation dims flattened into the MLP input (3 for MinAtar images)

    def flatten(self, obs: jax.Array) -> jax.Array:
        return obs.reshape(obs.shape[: obs.ndim - self.obs_rank] + (-1,)).astype(jnp.float32)

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[Categorical | DiagNormal, jax.Array]:
        act = _activation(self.activation)
        a = v = self.flatten(obs)
        ortho = nn.initializers.orthogonal
        for i, h in enumerate(self.hidden_sizes):
            a = act(nn.Dense(h, kernel_init=ortho(np.sqrt(2)), name=f"actor_{i}")(a))
            v = act(nn.Dense(h, kernel_init=ortho(np.sqrt(2)), name=f"critic_{i}")(v))
        out = nn.Dense(self.action_dim, kernel_init=ortho(0.01), name="actor_out")(a)
        value = nn.Dense(1, kernel_init=ortho(1.0), name="critic_out")(v)[..., 0]
        if self.discrete:
            return Categorical(out), value
        return DiagNormal(out, self.param("log_std", nn.initializers.zeros, (self.action_dim,))), value
