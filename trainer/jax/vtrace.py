"""V-trace off-policy value targets and policy-gradient advantages (Espeholt et al. 2018, "IMPALA: Scalable
Distributed Deep-RL with Importance Weighted Actor-Learner Architectures", section 4.1, eq. 1 and its
recursive form in Remark 1).

Actors act with a behaviour policy mu that lags the learner's pi; with rho_t = pi(a_t|x_t) / mu(a_t|x_t),

    v_s = V(x_s) + sum_{t >= s} (prod_{k=s}^{t-1} discount_k c_k) delta_t,
    delta_t = min(rho_bar, rho_t) (r_t + discount_t V(x_{t+1}) - V(x_t)),   c_i = lam min(c_bar, rho_i),

computed backwards as v_s - V(x_s) = delta_s + discount_s c_s (v_{s+1} - V(x_{s+1})). The policy gradient uses
min(pg_rho_bar, rho_s) (r_s + discount_s v_{s+1} - V(x_s)). `discount_t` is gamma, or 0 where the episode
terminated at step t (the paper writes a constant gamma; per-step discounts are how its released code handles
episode ends). `lam` weighs the traces as the paper's lambda variant does (1.0: eq. 1 as written).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class VTraceReturns(NamedTuple):
    vs: jax.Array  # value targets, [T, ...]
    pg_advantages: jax.Array  # [T, ...]


def vtrace(log_rhos: jax.Array, discounts: jax.Array, rewards: jax.Array, values: jax.Array,
           bootstrap_value: jax.Array, rho_bar: float = 1.0, c_bar: float = 1.0, pg_rho_bar: float | None = None,
           lam: float = 1.0) -> VTraceReturns:
    """Time-major arrays [T, ...] (any batch dimensions after T); `bootstrap_value` is V(x_T), shape [...].
    `log_rhos` = log pi(a_t|x_t) - log mu(a_t|x_t). Both outputs are constants for the gradient (targets)."""
    rhos = jnp.exp(log_rhos)
    clipped_rhos = jnp.minimum(rho_bar, rhos)
    cs = lam * jnp.minimum(c_bar, rhos)
    values_next = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    deltas = clipped_rhos * (rewards + discounts * values_next - values)

    def back(acc_next, x):
        delta, discount, c = x
        acc = delta + discount * c * acc_next
        return acc, acc

    _, corrections = jax.lax.scan(back, jnp.zeros_like(bootstrap_value), (deltas, discounts, cs), reverse=True)
    vs = values + corrections
    vs_next = jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0)
    pg_rhos = jnp.minimum(rho_bar if pg_rho_bar is None else pg_rho_bar, rhos)
    pg_advantages = pg_rhos * (rewards + discounts * vs_next - values)
    return VTraceReturns(jax.lax.stop_gradient(vs), jax.lax.stop_gradient(pg_advantages))
