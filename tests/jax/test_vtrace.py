"""V-trace (trainer/jax/vtrace.py) against values computed by hand, against the paper's sum formula evaluated
term by term, and against discounted returns in the on-policy case."""
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120, method="thread")


def _sum_formula(log_rhos, discounts, rewards, values, bootstrap, rho_bar, c_bar):
    """Espeholt et al. 2018, eq. 1, summed directly (no recursion), one trajectory."""
    T = len(rewards)
    rhos = np.exp(log_rhos)
    nxt = np.append(values[1:], bootstrap)
    deltas = np.minimum(rho_bar, rhos) * (rewards + discounts * nxt - values)
    cs = np.minimum(c_bar, rhos)
    vs = np.array(values, dtype=np.float64)
    for s in range(T):
        for t in range(s, T):
            vs[s] += np.prod(discounts[s:t] * cs[s:t]) * deltas[t]
    return vs


def test_vtrace_by_hand():
    import jax.numpy as jnp

    from trainer.jax.vtrace import vtrace

    out = vtrace(jnp.log(jnp.array([2.0, 0.5, 1.0])), jnp.full(3, 0.9), jnp.array([1.0, 0.0, 2.0]),
                 jnp.array([1.0, 2.0, 3.0]), jnp.array(4.0))
    # rho clipped at 1: (1, .5, 1); c the same. deltas: 1*(1 + .9*2 - 1) = 1.8; .5*(0 + .9*3 - 2) = .35;
    # 1*(2 + .9*4 - 3) = 2.6. Backwards: 2.6; .35 + .9*.5*2.6 = 1.52; 1.8 + .9*1*1.52 = 3.168.
    np.testing.assert_allclose(out.vs, [1.0 + 3.168, 2.0 + 1.52, 3.0 + 2.6], rtol=1e-6)
    # advantages: 1*(1 + .9*3.52 - 1) = 3.168; .5*(0 + .9*5.6 - 2) = 1.52; 1*(2 + .9*4 - 3) = 2.6
    np.testing.assert_allclose(out.pg_advantages, [3.168, 1.52, 2.6], rtol=1e-6)


def test_vtrace_matches_the_sum_formula_with_episode_ends():
    import jax.numpy as jnp

    from trainer.jax.vtrace import vtrace

    rng = np.random.default_rng(0)
    T, B = 12, 4
    log_rhos = rng.normal(scale=0.7, size=(T, B))
    discounts = 0.95 * (rng.random((T, B)) > 0.15)  # 0 where an episode terminated
    rewards, values, bootstrap = rng.normal(size=(T, B)), rng.normal(size=(T, B)), rng.normal(size=B)
    out = vtrace(jnp.asarray(log_rhos), jnp.asarray(discounts), jnp.asarray(rewards), jnp.asarray(values),
                 jnp.asarray(bootstrap), rho_bar=1.2, c_bar=0.9)
    for b in range(B):
        expected = _sum_formula(log_rhos[:, b], discounts[:, b], rewards[:, b], values[:, b], bootstrap[b], 1.2, 0.9)
        np.testing.assert_allclose(np.asarray(out.vs)[:, b], expected, rtol=1e-4, atol=1e-5)


def test_on_policy_vtrace_is_the_discounted_return():
    import jax.numpy as jnp

    from trainer.jax.vtrace import vtrace

    rng = np.random.default_rng(1)
    T = 10
    discounts = 0.9 * (rng.random(T) > 0.2)
    rewards, values, bootstrap = rng.normal(size=T), rng.normal(size=T), 0.3
    returns, g = np.zeros(T), bootstrap
    for t in reversed(range(T)):
        g = rewards[t] + discounts[t] * g
        returns[t] = g
    out = vtrace(jnp.zeros(T), jnp.asarray(discounts), jnp.asarray(rewards), jnp.asarray(values),
                 jnp.asarray(bootstrap))
    np.testing.assert_allclose(out.vs, returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.pg_advantages, returns - values, rtol=1e-5, atol=1e-6)


def test_pg_rho_bar_clips_only_the_policy_gradient_weight():
    import jax.numpy as jnp

    from trainer.jax.vtrace import vtrace

    args = (jnp.log(jnp.array([3.0])), jnp.array([0.0]), jnp.array([1.0]), jnp.array([0.5]), jnp.array(0.0))
    wide = vtrace(*args, rho_bar=1.0, pg_rho_bar=2.0)
    # one step that ends the episode: vs = V + min(1, 3) (r - V) = 1; the gradient weight min(2, 3) = 2
    np.testing.assert_allclose(wide.vs, [1.0], rtol=1e-6)
    np.testing.assert_allclose(wide.pg_advantages, [2.0 * 0.5], rtol=1e-6)
