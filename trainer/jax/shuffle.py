"""Uniform random permutations built from single-operand uint32 sorts.

`jax.random.permutation` sorts (random key, value) pairs. XLA:CPU runs a multi-operand sort through a
generic comparator call per comparison, while a single uint32 operand goes to a native sort: measured
here 3.5-4x faster for 8k to 262k elements (2.2 vs 8.2 ms at 8192, 55 vs 226 ms at 262144). PPO shuffles
its whole batch every epoch, so at 64 to 2048 envs that sort was a fifth of the update's CPU time.

Each round packs random high bits above each position's index (low `k` bits) into one word and sorts it.
Sorting by (fresh random bits, previous position) and composing the rounds orders the elements
lexicographically by all rounds' random bits, so the result is uniform up to full ties, which are broken
by index exactly as in `jax.random.permutation`. Rounds are chosen with the same bound jax uses (at least
3 log2 n random bits in all), so ties are as rare as there.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Above this the packed words have too few random bits per round to be worth it.
_MAX_INDEX_BITS = 24


def permutation(key: jax.Array, n: int) -> jax.Array:
    """A uniformly random permutation of range(n) as int32 (n static)."""
    if n <= 1:
        return jnp.zeros((n,), jnp.int32)
    index_bits = math.ceil(math.log2(n))  # n >= 2 here, so at least 1
    if index_bits > _MAX_INDEX_BITS:
        return jax.random.permutation(key, n)
    random_bits = 32 - index_bits
    rounds = math.ceil(3 * math.log2(n) / random_bits)
    positions = lax.iota(jnp.uint32, n)
    low = jnp.uint32((1 << index_bits) - 1)
    perm = None
    for round_key in jax.random.split(key, rounds):
        high = jax.random.bits(round_key, (n,), jnp.uint32) >> index_bits << index_bits
        order = lax.sort(high | positions) & low
        perm = order if perm is None else perm[order]
    return perm.astype(jnp.int32)
