"""A seed's state laid out over its data shards: every leaf gets a leading [shards] axis, parameters identical on
every shard, environments and RNG streams not. Shared by every algorithm's `init_seed`."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from trainer.jax.envs import Environment, reset_slot


def reset_shards(env: Environment, key: jax.Array, shards: int, envs_per_shard: int):
    """Every shard's env slots, first observations and RNG key: (slot, obs, key), each [shards, ...]."""
    def one(k):
        k_reset, k_run = jax.random.split(k)
        obs, slot = jax.vmap(lambda kk: reset_slot(env, kk))(jax.random.split(k_reset, envs_per_shard))
        return slot, obs, k_run

    return jax.jit(jax.vmap(one))(jax.random.split(key, shards))


def replicate(tree: Any, shards: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (shards,) + jnp.shape(x)), tree)
