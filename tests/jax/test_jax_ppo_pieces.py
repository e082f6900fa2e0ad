"""PPO building blocks against hand-computed references."""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120, method="thread")


def _gae_reference(rewards, values, dones, last_value, gamma, lam):
    T, adv, nxt_adv, nxt_v = len(rewards), np.zeros(len(rewards)), 0.0, last_value
    for t in reversed(range(T)):
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * nxt_v * live - values[t]
        nxt_adv = delta + gamma * lam * live * nxt_adv
        adv[t], nxt_v = nxt_adv, values[t]
    return adv


def test_gae_matches_loop_and_hand_values():
    import jax.numpy as jnp

    from trainer.jax.ppo import gae

    r = np.array([1.0, 1.0, 1.0, 0.5])
    v = np.array([0.5, 0.4, 0.3, 0.2])
    d = np.array([0.0, 1.0, 0.0, 0.0])
    adv, target = gae(jnp.asarray(r)[:, None], jnp.asarray(v)[:, None], jnp.asarray(d)[:, None],
                      jnp.asarray([0.7]), 0.9, 0.8)
    # By hand (gamma .9, lambda .8): step 3: 0.5 + .9*.7 - .2 = 0.93; step 2: 1 + .9*.2 - .3 = 0.88,
    # + .72*.93 = 1.5496; step 1 ends the episode: 1 - .4 = 0.6; step 0: 1 + .9*.4 - .5 = 0.86, + .72*.6.
    expected = np.array([0.86 + 0.72 * 0.6, 0.6, 1.5496, 0.93])
    np.testing.assert_allclose(np.asarray(adv)[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(target)[:, 0], expected + v, rtol=1e-6)

    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(50, 3)), rng.normal(size=(50, 3))
    d, last = (rng.random((50, 3)) < 0.1).astype(np.float32), rng.normal(size=3)
    adv, _ = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(d), jnp.asarray(last), 0.99, 0.95)
    for e in range(3):
        np.testing.assert_allclose(np.asarray(adv)[:, e], _gae_reference(r[:, e], v[:, e], d[:, e], last[e], 0.99, 0.95),
                                   rtol=1e-5, atol=1e-5)


def test_gae_bootstraps_an_episode_cut_by_the_time_limit_by_hand():
    import jax.numpy as jnp

    from trainer.jax.ppo import gae

    r, v = np.array([1.0, 1.0, 1.0, 0.5]), np.array([0.5, 0.4, 0.3, 0.2])
    d = np.array([0.0, 1.0, 0.0, 0.0])
    end = np.array([0.0, 0.9, 0.0, 0.0])  # step 1 was cut by the time limit; its last observation is worth 0.9
    adv, target = gae(*(jnp.asarray(x)[:, None] for x in (r, v, d)), jnp.asarray([0.7]), 0.9, 0.8,
                      jnp.asarray(end)[:, None])
    # By hand (gamma .9, lambda .8): steps 3 and 2 as without the cut (0.93, 1.5496); step 1 bootstraps from
    # the cut: 1 + .9*.9 - .4 = 1.41, and its trace stops there; step 0: 1 + .9*.4 - .5 = 0.86, + .72*1.41.
    expected = np.array([0.86 + 0.72 * 1.41, 1.41, 1.5496, 0.93])
    np.testing.assert_allclose(np.asarray(adv)[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(target)[:, 0], expected + v, rtol=1e-6)


def test_auto_reset_reports_time_limit_cuts_and_the_last_observation():
    """Truncated (not terminated) steps are flagged with the episode's last observation; an episode the task
    ends at the time limit is an end, not a cut."""
    import jax
    import jax.numpy as jnp
    from toy_env import Walk

    from trainer.jax.envs import EnvSlot, auto_reset_step

    env, key = Walk(), jax.random.PRNGKey(0)

    def step(pos: float, t: int, action: int):
        slot = EnvSlot((jnp.float32(pos), jnp.int32(t)), jnp.float32(0.0), jnp.int32(t))
        return auto_reset_step(env, key, key, slot, jnp.int32(action))

    cut = step(0.0, 19, 0)  # the 20th step ends at -1: the time limit, not the goal
    assert bool(cut.done) and bool(cut.truncated) and float(cut.final_obs[0]) == -1.0
    assert float(cut.obs[0]) in (-1.0, 0.0, 1.0) and int(cut.slot.state[1]) == 0  # a new episode
    goal = step(2.0, 19, 1)  # reaches +3 on the 20th step: terminated and truncated at once
    assert bool(goal.done) and not bool(goal.truncated) and float(goal.final_obs[0]) == 3.0
    mid = step(0.0, 3, 1)
    assert not bool(mid.done) and not bool(mid.truncated) and float(mid.final_obs[0]) == float(mid.obs[0]) == 1.0


def test_clipped_losses_by_hand():
    import jax.numpy as jnp

    from trainer.jax.ppo import clipped_losses

    old_logp = jnp.zeros(3)
    logp = jnp.log(jnp.array([1.5, 0.5, 1.1]))  # ratios 1.5, 0.5, 1.1
    adv = jnp.array([1.0, 1.0, -2.0])
    value, old_value, target = jnp.array([1.0, 0.0, 2.0]), jnp.array([0.5, 0.0, 2.0]), jnp.array([2.0, 1.0, 2.0])
    pg, vl, clip_frac = clipped_losses(logp, old_logp, adv, value, old_value, target, clip_eps=0.2)
    # surrogates: min(1.5, 1.2)=1.2; min(0.5, 0.8)=0.5; min(-2.2, -2.2)=-2.2 -> loss -(1.2+0.5-2.2)/3
    assert float(pg) == pytest.approx(-(1.2 + 0.5 - 2.2) / 3, rel=1e-6)
    # value: clipped prediction 0.7 for the first -> max(1, 1.69)=1.69; second max(1,1)=1; third 0
    assert float(vl) == pytest.approx(0.5 * (1.69 + 1.0 + 0.0) / 3, rel=1e-6)
    assert float(clip_frac) == pytest.approx(2 / 3)


def test_distributions_by_hand():
    import jax
    import jax.numpy as jnp

    from trainer.jax.distributions import Categorical, DiagNormal

    logits = jnp.log(jnp.array([[0.2, 0.3, 0.5]]))
    cat = Categorical(logits)
    assert float(cat.log_prob(jnp.array([2]))[0]) == pytest.approx(math.log(0.5), rel=1e-6)
    assert float(cat.entropy()[0]) == pytest.approx(-sum(p * math.log(p) for p in (0.2, 0.3, 0.5)), rel=1e-6)
    draws = cat.sample_with(Categorical.noise(jax.random.PRNGKey(0), (20000,), 3)[:, None, :])[:, 0]
    np.testing.assert_allclose(np.bincount(np.asarray(draws), minlength=3) / 20000, [0.2, 0.3, 0.5], atol=0.015)

    norm = DiagNormal(jnp.array([[1.0, -1.0]]), jnp.log(jnp.array([2.0, 0.5])))
    x = jnp.array([[2.0, 0.0]])
    ref = sum(-0.5 * ((xi - m) / s) ** 2 - math.log(s) - 0.5 * math.log(2 * math.pi)
              for xi, m, s in ((2.0, 1.0, 2.0), (0.0, -1.0, 0.5)))
    assert float(norm.log_prob(x)[0]) == pytest.approx(ref, rel=1e-6)
    ent = sum(0.5 * math.log(2 * math.pi * math.e * s * s) for s in (2.0, 0.5))
    assert float(norm.entropy()[0]) == pytest.approx(ent, rel=1e-6)


def test_config_validation_and_no_jax_import():
    import subprocess
    import sys

    code = ("import sys; from trainer.jax.config import JaxConfig; JaxConfig(); "
            "assert 'jax' not in sys.modules, 'config imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True)
    from pydantic import ValidationError

    from trainer.jax.config import JaxConfig

    with pytest.raises(ValidationError):
        JaxConfig(num_envs=6, shards=4)
    with pytest.raises(ValidationError):
        JaxConfig(unknown_field=1)


def test_chunked_gradient_equals_whole_minibatch_gradient():
    """Differentiating a minibatch in row chunks is a speed choice only: same parameters after a chunk."""
    from jax_helpers import tiny
    from trainer.jax.engine import Engine, flat_params

    # 4 envs x 16 steps / 2 minibatches = 32 rows per minibatch; 8-row chunks give 4 chunks
    whole, chunked = (Engine(tiny(grad_chunk_rows=rows), total_updates=4, seed=0, devices=1) for rows in (0, 8))
    a, _ = whole.run_chunk(whole.init_state())
    b, _ = chunked.run_chunk(chunked.init_state())
    np.testing.assert_allclose(flat_params(a), flat_params(b), rtol=0, atol=1e-5)
    assert np.abs(flat_params(a) - flat_params(whole.init_state())).max() > 1e-4  # the update did move them


def test_critic_chunks_equal_one_pass_over_the_rollout(monkeypatch):
    """The post-rollout critic runs in time chunks to bound memory: same parameters as one pass."""
    from jax_helpers import tiny
    from trainer.jax import ppo
    from trainer.jax.engine import Engine, flat_params

    results = []
    for rows in (1 << 30, 8):  # one pass; 8 rows = 2 steps of 4 envs per chunk
        monkeypatch.setattr(ppo, "CRITIC_CHUNK_ROWS", rows)
        engine = Engine(tiny(), total_updates=4, seed=0, devices=1)
        results.append(flat_params(engine.run_chunk(engine.init_state())[0]))
    np.testing.assert_allclose(results[0], results[1], rtol=0, atol=1e-5)

@pytest.mark.parametrize("n", [1, 2, 5, 1000, 8192, 40_000])
def test_permutation_is_a_permutation_and_keyed(n):
    import jax

    from trainer.jax.shuffle import permutation

    perm = np.asarray(jax.jit(permutation, static_argnums=1)(jax.random.PRNGKey(7), n))
    assert perm.dtype == np.int32 and sorted(perm.tolist()) == list(range(n))
    again = np.asarray(permutation(jax.random.PRNGKey(7), n))
    np.testing.assert_array_equal(perm, again)
    if n >= 1000:
        other = np.asarray(permutation(jax.random.PRNGKey(8), n))
        assert (other != perm).mean() > 0.99
        assert abs(np.corrcoef(np.arange(n), perm)[0, 1]) < 0.05


def test_permutation_is_uniform():
    """All 24 orders of 4 elements equally often (chi-square, 23 dof, p ~ 1e-6 cut-off), and each element
    lands in each position equally often for a size that needs several sort rounds."""
    import jax

    from trainer.jax.shuffle import permutation

    keys = jax.random.split(jax.random.PRNGKey(0), 48_000)
    perms = np.asarray(jax.jit(jax.vmap(lambda k: permutation(k, 4)))(keys))
    _, counts = np.unique(perms, axis=0, return_counts=True)
    assert len(counts) == 24
    expected = len(perms) / 24
    assert ((counts - expected) ** 2 / expected).sum() < 60.0

    n = 1 << 16  # 16 index bits, 16 random bits per round: 3 rounds
    perms = np.asarray(jax.jit(jax.vmap(lambda k: permutation(k, n)))(jax.random.split(jax.random.PRNGKey(1), 64)))
    position_of_first = np.argmax(perms == 0, axis=1)
    assert np.unique(position_of_first).size > 60
    assert abs(position_of_first.mean() / n - 0.5) < 0.15


def test_permutation_falls_back_beyond_its_index_bits(monkeypatch):
    import jax

    from trainer.jax import shuffle

    monkeypatch.setattr(shuffle, "_MAX_INDEX_BITS", 4)
    perm = np.asarray(shuffle.permutation(jax.random.PRNGKey(3), 100))
    np.testing.assert_array_equal(perm, np.asarray(jax.random.permutation(jax.random.PRNGKey(3), 100)))


@pytest.mark.parametrize("steps,limit", [(128, 500), (16, 5), (12, 4), (9, 9)])
def test_cut_values_with_a_time_limit_equal_the_full_pass(steps, limit):
    """cut_values evaluates only the (at most ceil(T / L)) cut steps per env; where cuts are at least L apart, as
    a time limit L makes them, the result is the full pass's, value for value."""
    import jax
    import jax.numpy as jnp

    from trainer.jax.on_policy import cut_values

    rng = np.random.default_rng(steps * 31 + limit)
    n = 6
    truncated = np.zeros((steps, n), bool)
    for env in range(n):  # cuts L or more steps apart, starting anywhere (the episode may predate the rollout)
        t = int(rng.integers(0, limit + 3))
        while t < steps:
            truncated[t, env] = True
            t += limit + int(rng.integers(0, 3))
    truncated[:, 0] = False  # one env never cut
    final_obs = jnp.asarray(rng.normal(size=(steps, n, 3)), jnp.float32)
    calls = []

    def value_fn(obs):
        calls.append(obs.shape)
        return jnp.sum(obs * jnp.array([1.0, -2.0, 0.5]), axis=-1)

    full = cut_values(value_fn, jnp.asarray(truncated), final_obs, None)
    cut = jax.jit(lambda t, o: cut_values(value_fn, t, o, limit))(jnp.asarray(truncated), final_obs)
    np.testing.assert_array_equal(np.asarray(cut), np.asarray(full))
    assert np.count_nonzero(np.asarray(full)) == np.count_nonzero(truncated)
    assert calls[0] == (steps, n, 3)
    assert calls[1] == (math.ceil(steps / limit), n, 3)  # only the steps that can have been cut


def test_gymnax_and_brax_envs_declare_their_time_limit():
    from trainer.jax.envs import make_env

    assert make_env("CartPole-v1").max_episode_steps == 500
    assert make_env("Pendulum-v1").max_episode_steps == 200
    assert make_env("brax/inverted_pendulum", episode_length=300).max_episode_steps == 300
