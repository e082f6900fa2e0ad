"""Observation normalisation and reward scaling (trainer/jax/normalization.py) against hand-computed values, and
PPO with both switched on."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300, method="thread")


def test_moments_pool_batches_and_shards_like_one_big_batch():
    import jax
    import jax.numpy as jnp

    from trainer.jax.normalization import init_moments, update_moments

    rng = np.random.default_rng(0)
    a, b = rng.normal(3.0, 2.0, (5, 2)), rng.normal(-1.0, 0.5, (7, 2))
    m = update_moments(update_moments(init_moments((2,)), jnp.asarray(a)), jnp.asarray(b))
    both = np.concatenate([a, b])
    np.testing.assert_allclose(m.mean, both.mean(0), rtol=1e-5)
    np.testing.assert_allclose(m.var, both.var(0), rtol=1e-5)  # population variance
    assert float(m.count) == 12
    # by hand: rows 1, 3 then 5 -> mean 3, variance ((1-3)^2 + 0 + (5-3)^2) / 3 = 8/3
    h = update_moments(update_moments(init_moments(), jnp.array([1.0, 3.0])), jnp.array([5.0]))
    assert float(h.mean) == pytest.approx(3.0) and float(h.var) == pytest.approx(8 / 3)
    # two shards (a named vmap axis) pool their rows: every shard ends with the statistics of all of them
    shards = jnp.asarray(rng.normal(0.0, 1.0, (2, 4, 2)))
    pooled = jax.vmap(lambda r: update_moments(init_moments((2,)), r, ("shard",)), axis_name="shard")(shards)
    flat = np.asarray(shards).reshape(-1, 2)
    for s in range(2):
        np.testing.assert_allclose(pooled.mean[s], flat.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pooled.var[s], flat.var(0), rtol=1e-5)


def test_normalize_standardises_and_clips():
    import jax.numpy as jnp

    from trainer.jax.normalization import Moments, normalize

    m = Moments(jnp.array([1.0, -2.0]), jnp.array([4.0, 0.25]), jnp.array(10.0))
    out = np.asarray(normalize(jnp.array([[3.0, -2.5], [1.0, 10.0]]), m, clip=5.0))
    np.testing.assert_allclose(out, [[1.0, -1.0], [0.0, 5.0]], rtol=1e-5)  # (10 + 2) / 0.5 = 24, clipped to 5


def test_discounted_sums_reset_after_an_episode_ends_and_scale_by_their_std():
    import jax.numpy as jnp

    from trainer.jax.normalization import Moments, discounted_sums, scale_rewards

    # one env, gamma 0.5, carried sum 2 from the previous rollout: R = 0.5*2+1 = 2, 0.5*2+1 = 2 (ends), then
    # 0 + 4 = 4, 0.5*4 + 0 = 2
    r = jnp.array([1.0, 1.0, 4.0, 0.0])[:, None]
    d = jnp.array([False, True, False, False])[:, None]
    sums, carry = discounted_sums(jnp.array([2.0]), r, d, 0.5)
    np.testing.assert_allclose(np.asarray(sums)[:, 0], [2.0, 2.0, 4.0, 2.0])
    assert float(carry[0]) == 2.0
    m = Moments(jnp.zeros(()), jnp.array(4.0), jnp.array(4.0))
    np.testing.assert_allclose(np.asarray(scale_rewards(jnp.array([1.0, -3.0, 30.0]), m, clip=10.0)),
                               [0.5, -1.5, 10.0], rtol=1e-6)  # divided by std 2, not centred; 15 clipped


def test_ppo_with_normalisation_tracks_every_observation_and_trains_on_the_inputs_the_policy_saw():
    import jax

    from jax_helpers import tiny
    from trainer.jax.engine import Engine, summarize

    # lr ~ 0 and one minibatch per update: the loss then sees the policy that acted, so its log-probabilities
    # are the rollout's exactly if it is given the inputs the policy saw (normalised with the statistics from
    # before the rollout, not the ones updated with it)
    cfg = tiny(env="Pendulum-v1", num_envs=4, num_steps=16, updates_per_iteration=3, shards=2, epochs=1,
               minibatches=1, lr=1e-12, normalize_observations=True, scale_rewards=True)
    engine = Engine(cfg, total_updates=3, seed=0, devices=1)
    state, metrics = engine.run_chunk(engine.init_state())
    s = summarize(metrics)
    m = jax.device_get(state.obs_moments)
    # every env step of both shards, pooled: the same statistics on every shard
    assert float(m.count[0, 0]) == float(m.count[0, 1]) == 3 * 16 * 4
    np.testing.assert_allclose(m.mean[0, 0], m.mean[0, 1])
    assert np.all(m.var[0, 0] > 0) and np.all(np.abs(m.mean[0, 0]) < 8.1)  # Pendulum: cos, sin, velocity <= 8
    assert float(jax.device_get(state.return_moments.count)[0, 0]) == 3 * 16 * 4
    assert np.isfinite(s["pg_loss"]) and abs(s["approx_kl"]) < 1e-9 and s["clip_frac"] == 0.0


def test_normalisation_fields_are_ppo_only():
    from trainer.jax.config import JaxConfig

    with pytest.raises(ValueError, match="normalize_observations"):
        JaxConfig(algorithm="sac", normalize_observations=True)
