"""Running observation normalisation and reward scaling for PPO (`jax.normalize_observations`, `jax.scale_rewards`).

Both are the "observation normalization" and "reward scaling" of Engstrom et al. 2020, "Implementation Matters in
Deep Policy Gradients: A Case Study on PPO and TRPO" (section 3 and appendix A.2, as in the baselines code the
paper studies): observations are standardised by their running mean and variance and clipped to +-clip; rewards
are divided by the running standard deviation of a discounted sum of rewards R_t = gamma R_{t-1} + r_t (reset to 0
after an episode ends) and clipped to +-clip, not centred.

Variant, by name: the statistics are updated once per rollout with all of its steps (every env of every shard
pooled), not after every env step, and the rollout is normalised with the statistics from before it; the update
then trains on exactly the inputs the acting policy saw, so its first log-probabilities are the rollout's."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

EPS = 1e-8


class Moments(NamedTuple):
    """Running mean and (population) variance of everything seen so far, and how many rows that was."""
    mean: jax.Array
    var: jax.Array
    count: jax.Array  # float32 scalar


def init_moments(shape: Sequence[int] = ()) -> Moments:
    return Moments(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32), jnp.zeros((), jnp.float32))


def update_moments(m: Moments, rows: jax.Array, axes: Sequence[str] = ()) -> Moments:
    """`m` with the rows of `rows` ([N, *shape]) added, pooled with every shard's rows over the named `axes`
    (Chan, Golub and LeVeque 1979, "Updating Formulae and a Pairwise Algorithm for Computing Sample Variances":
    the pairwise combination of two sets' counts, means and sums of squared deviations)."""
    axes = tuple(axes)

    def psum(x):
        return jax.lax.psum(x, axes) if axes else x

    rows = rows.astype(jnp.float32)
    n = psum(jnp.asarray(rows.shape[0], jnp.float32))
    mean = psum(jnp.sum(rows, axis=0)) / n
    m2 = psum(jnp.sum(jnp.square(rows - mean), axis=0))
    total = m.count + n
    delta = mean - m.mean
    new_mean = m.mean + delta * (n / total)
    new_m2 = m.var * m.count + m2 + jnp.square(delta) * (m.count * n / total)
    return Moments(new_mean, new_m2 / total, total)


def normalize(x: jax.Array, m: Moments, clip: float) -> jax.Array:
    """(x - mean) / sqrt(var + eps), clipped to [-clip, clip]."""
    return jnp.clip((x - m.mean) * jax.lax.rsqrt(m.var + EPS), -clip, clip)


def discounted_sums(start: jax.Array, rewards: jax.Array, dones: jax.Array, gamma: float) -> tuple[jax.Array, jax.Array]:
    """R_t = gamma R_{t-1} + r_t over time-major [T, n] rewards, from R_{-1} = `start` [n], R set to 0 after a step
    that ended its episode. Returns (R [T, n], the carry for the next rollout [n])."""
    def step(carry, x):
        r, d = x
        ret = gamma * carry + r
        return jnp.where(d, 0.0, ret), ret

    carry, sums = jax.lax.scan(step, start, (rewards, dones))
    return sums, carry


def scale_rewards(rewards: jax.Array, m: Moments, clip: float) -> jax.Array:
    """r / sqrt(var(R) + eps), clipped to [-clip, clip] (not centred: the sign of a reward is kept)."""
    return jnp.clip(rewards * jax.lax.rsqrt(m.var + EPS), -clip, clip)
