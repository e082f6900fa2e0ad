"""Action distributions, written out to avoid distrax (which pulls tfp-nightly and dm-tree)."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Categorical(NamedTuple):
    logits: jax.Array  # [..., n]

    def sample(self, key: jax.Array) -> jax.Array:
        return jax.random.categorical(key, self.logits, axis=-1)

    @staticmethod
    def noise(key: jax.Array, shape: tuple[int, ...], n: int) -> jax.Array:
        """Gumbel noise for `sample_with`: one draw for many steps, generated outside the rollout loop."""
        return jax.random.gumbel(key, shape + (n,))

    def sample_with(self, noise: jax.Array) -> jax.Array:
        return jnp.argmax(self.logits + noise, axis=-1)

    def log_prob(self, action: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(self.logits, axis=-1)
        # one-hot product, not take_along_axis: its gradient is a scatter, slow on XLA:CPU
        return jnp.sum(jax.nn.one_hot(action, self.logits.shape[-1], dtype=logp.dtype) * logp, axis=-1)

    def entropy(self) -> jax.Array:
        logp = jax.nn.log_softmax(self.logits, axis=-1)
        return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


class DiagNormal(NamedTuple):
    mean: jax.Array  # [..., d]
    log_std: jax.Array  # broadcastable to mean

    def sample(self, key: jax.Array) -> jax.Array:
        return self.mean + jnp.exp(self.log_std) * jax.random.normal(key, self.mean.shape, self.mean.dtype)

    @staticmethod
    def noise(key: jax.Array, shape: tuple[int, ...], n: int) -> jax.Array:
        return jax.random.normal(key, shape + (n,))

    def sample_with(self, noise: jax.Array) -> jax.Array:
        return self.mean + jnp.exp(self.log_std) * noise

    def log_prob(self, action: jax.Array) -> jax.Array:
        z = (action - self.mean) * jnp.exp(-self.log_std)
        per_dim = -0.5 * z**2 - self.log_std - 0.5 * math.log(2 * math.pi)
        return jnp.sum(per_dim, axis=-1)

    def entropy(self) -> jax.Array:
        per_dim = self.log_std + 0.5 * (1.0 + math.log(2 * math.pi))
        return jnp.sum(jnp.broadcast_to(per_dim, self.mean.shape), axis=-1)
