"""IMPALA-style learner (trainer/jax/impala.py): the actors' parameter lag, on-policy importance ratios of 1, and
learning CartPole. V-trace itself is checked by hand in test_vtrace.py."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_helpers import IMPALA_TINY

pytestmark = pytest.mark.timeout(240, method="thread")


def _engine(updates: int = 1, **overrides):
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    impala = {**IMPALA_TINY["impala"], **overrides.pop("impala", {})}
    cfg = JaxConfig(**{**IMPALA_TINY, "updates_per_iteration": updates, **overrides, "impala": impala})
    return Engine(cfg, total_updates=10, seed=0, devices=1)


def test_actors_act_with_parameters_lag_updates_old():
    engine = _engine(impala={"lag": 2})
    s0 = engine.init_state()
    p0 = np.asarray(s0.params)
    np.testing.assert_array_equal(np.asarray(s0.history), np.broadcast_to(p0[:, :, None], s0.history.shape))
    s1, _ = engine.run_chunk(s0)
    p1 = np.asarray(s1.params)
    s2, _ = engine.run_chunk(s1)
    h2 = np.asarray(s2.history)
    # after two updates the ring holds the learner's parameters before each: [p0, p1]; the next actors use p0
    np.testing.assert_array_equal(h2[:, :, 0], p0)
    np.testing.assert_array_equal(h2[:, :, 1], p1)
    assert np.abs(p1 - p0).max() > 0  # the learner moved


def test_on_policy_actors_have_importance_ratios_of_one():
    from trainer.jax.engine import summarize

    engine = _engine(updates=2, impala={"lag": 0, "minibatches": 1})
    _, metrics = engine.run_chunk(engine.init_state())
    s = summarize(metrics)
    assert s["rho_mean"] == pytest.approx(1.0, abs=1e-6) and s["rho_clip_frac"] == 0.0
    lagged = _engine(updates=2, impala={"lag": 1, "minibatches": 1})
    _, metrics = lagged.run_chunk(lagged.init_state())
    rhos, clipped = jax.device_get(metrics.rho_mean)[0, 0], jax.device_get(metrics.rho_clip_frac)[0, 0]
    # update 1: the actors' parameters (the initial ones) are the learner's; update 2: one update behind
    assert rhos[0] == pytest.approx(1.0, abs=1e-6) and clipped[0] == 0.0
    assert clipped[1] > 0  # some ratios above rho_bar = 1 (their mean stays near 1: E_mu[pi/mu] = 1)


def test_impala_learns_cartpole():
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine, summarize

    cfg = JaxConfig(algorithm="impala", env="CartPole-v1", num_envs=16, num_steps=32, updates_per_iteration=50,
                    lr=1e-3, impala={"lag": 1, "minibatches": 4})
    engine = Engine(cfg, total_updates=4 * 50, seed=0, devices=1)
    state, returns = engine.init_state(), []
    for _ in range(4):  # 102,400 env steps
        state, metrics = engine.run_chunk(state)
        returns.append(summarize(metrics)["episode_return_mean"])
    assert returns[0] < 150 and max(returns) >= 200, returns
