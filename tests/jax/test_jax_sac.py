"""SAC (trainer/jax/sac.py): its pieces against values computed by hand, the config's refusals, learning Pendulum
with configs/pendulum_sac.yaml, and prioritized replay's bookkeeping."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240, method="thread")
ROOT = Path(__file__).resolve().parents[2]


def test_squashed_log_prob_by_hand():
    import jax.numpy as jnp

    from trainer.jax.sac import squashed_log_prob

    # one dimension: u = 0.5, mean 0.2, std e^-0.5. Gaussian: z = 0.3 e^0.5 = 0.494616, log N = -z^2/2 + 0.5
    # - 0.918939 = -0.541261; tanh(0.5) = 0.462117, log(1 - 0.213552) = -0.240229; log pi = -0.301032.
    got = squashed_log_prob(jnp.array([0.5]), jnp.array([0.2]), jnp.array([-0.5]))
    np.testing.assert_allclose(got, -0.301032, atol=2e-6)
    # two dimensions add; large |u| stays finite where 1 - tanh(u)^2 rounds to 0 in float32
    u, mean, log_std = np.array([0.3, -1.2]), np.array([0.0, -1.0]), np.array([0.1, -0.3])
    ref = np.sum(-0.5 * ((u - mean) / np.exp(log_std)) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
                 - np.log(1 - np.tanh(u) ** 2))
    np.testing.assert_allclose(squashed_log_prob(*(jnp.asarray(x, jnp.float32) for x in (u, mean, log_std))), ref,
                               rtol=1e-5)
    far = squashed_log_prob(jnp.array([30.0]), jnp.array([30.0]), jnp.array([0.0]))
    # log(1 - tanh(30)^2) = log(4) - 60 + O(e^-60): log pi = -0.918939 - (1.386294 - 60)
    np.testing.assert_allclose(far, -0.918939 - (math.log(4) - 60.0), rtol=1e-6)


def test_soft_target_and_losses_by_hand():
    import jax
    import jax.numpy as jnp

    from trainer.jax.sac import actor_loss, critic_loss, soft_q_target, temperature_loss

    reward, terminated = jnp.array([1.0, -2.0]), jnp.array([0.0, 1.0])
    next_qs = jnp.array([[3.0, 5.0], [2.5, 7.0]])  # twin critics x batch
    next_logp = jnp.array([-1.0, 0.3])
    y = soft_q_target(reward, terminated, next_qs, next_logp, jnp.asarray(0.2), 0.9)
    # sample 0: 1 + .9 * (min(3, 2.5) - .2 * -1) = 1 + .9 * 2.7 = 3.43; sample 1 ended: -2
    np.testing.assert_allclose(y, [3.43, -2.0], rtol=1e-6)

    qs = jnp.array([[3.0, -1.0], [4.0, -2.5]])
    # 0.5 (q - y)^2 summed over the twins: sample 0: .5 (.43^2 + .57^2) = .2549; sample 1: .5 (1 + .25) = .625
    np.testing.assert_allclose(critic_loss(qs, y, jnp.ones(2)), (0.2549 + 0.625) / 2, rtol=1e-5)
    np.testing.assert_allclose(critic_loss(qs, y, jnp.array([1.0, 0.0])), 0.2549 / 2, rtol=1e-5)
    # alpha log pi - min Q: (.2 * -1 - 3) and (.2 * .3 - -2.5) -> mean (-3.2 + 2.56) / 2
    np.testing.assert_allclose(actor_loss(next_logp, qs, jnp.asarray(0.2)), (-3.2 + 2.56) / 2, rtol=1e-6)
    # a masked-out state (an empty replay slot drawn) does not count
    np.testing.assert_allclose(actor_loss(next_logp, qs, jnp.asarray(0.2), jnp.array([1.0, 0.0])), -3.2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(temperature_loss)(jnp.asarray(0.3), next_logp, -1.0, jnp.array([0.0, 1.0])),
                               -(0.3 - 1.0), rtol=1e-6)
    # -log alpha * mean(log pi + target): log pi mean -.35, target -1 -> 1.35 log alpha; gradient 1.35
    assert float(temperature_loss(jnp.asarray(0.0), next_logp, -1.0)) == 0.0
    np.testing.assert_allclose(jax.grad(temperature_loss)(jnp.asarray(0.3), next_logp, -1.0), 1.35, rtol=1e-6)


def test_importance_weights_and_annealing_by_hand():
    import jax.numpy as jnp

    from trainer.jax.sac import importance_weights, linear

    # N = 4, P = (.1, .4, .25): (N P)^-.5 = (.4^-.5, 1.6^-.5, 1) = (1.581139, .790569, 1); / max
    w = importance_weights(jnp.array([0.1, 0.4, 0.25]), jnp.asarray(4.0), jnp.asarray(0.5))
    np.testing.assert_allclose(w, [1.0, 0.5, 1 / 1.581139], rtol=1e-5)
    np.testing.assert_allclose(importance_weights(jnp.array([0.1, 0.4]), jnp.asarray(4.0), jnp.asarray(0.0)), [1, 1])
    np.testing.assert_allclose([linear(0.4, 1.0, jnp.asarray(f)) for f in (0.0, 0.5, 1.0, 2.0)], [0.4, 0.7, 1.0, 1.0],
                               rtol=1e-6)


def test_config_refuses_fields_the_algorithm_does_not_read():
    from pydantic import ValidationError

    from trainer.jax.config import JaxConfig

    with pytest.raises(ValidationError, match=r"jax.clip_eps, jax.epochs are not read by algorithm sac"):
        JaxConfig(algorithm="sac", env="Pendulum-v1", epochs=8, clip_eps=0.1)
    with pytest.raises(ValidationError, match=r"jax.sac is read only with `algorithm: sac`"):
        JaxConfig(env="CartPole-v1", sac={"batch_size": 64})
    with pytest.raises(ValidationError, match="buffer_size must hold"):
        JaxConfig(algorithm="sac", env="Pendulum-v1", num_envs=4, num_steps=8, sac={"buffer_size": 16})
    with pytest.raises(ValidationError, match="jax.gae_lambda is not read by algorithm impala"):
        JaxConfig(algorithm="impala", gae_lambda=0.9)
    assert JaxConfig(algorithm="sac", env="Pendulum-v1").sac.batch_size == 256  # defaults filled in
    # a resolved config writes every field out, PPO's defaults included: it loads back
    resolved = JaxConfig(algorithm="sac", env="Pendulum-v1").model_dump()
    assert JaxConfig(**resolved).algorithm == "sac"
    assert not JaxConfig(algorithm="sac").lr_annealed and JaxConfig().lr_annealed


def test_sac_needs_continuous_actions():
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    with pytest.raises(ValueError, match="algorithm sac needs continuous"):
        Engine(JaxConfig(algorithm="sac", env="CartPole-v1"), total_updates=1, seed=0)


def test_prioritized_replay_sets_priorities_and_never_samples_an_empty_slot():
    """After updates the sum tree holds |TD|^alpha for the sampled transitions (not the initial max), every
    slot past the filled part keeps priority 0, and the weights stay finite."""
    import jax
    import jax.numpy as jnp

    from jax_helpers import SAC_TINY
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    cfg = JaxConfig(**{**SAC_TINY, "sac": {**SAC_TINY["sac"], "prioritized": True, "buffer_size": 128}})
    engine = Engine(cfg, total_updates=8, seed=0, devices=1)
    state = engine.init_state()
    for _ in range(3):
        state, metrics = engine.run_chunk(state)
    m = jax.device_get(metrics)
    assert np.all(np.isfinite(m.critic_loss)) and m.gradient_steps[0, 0, -1] == cfg.sac.gradient_steps
    from flashbax.buffers import sum_tree

    tree = jax.tree.map(lambda x: x[0, 0], state.buffer.sum_tree_state)
    filled = int(state.env_steps[0, 0])
    leaves = np.asarray(sum_tree.get(tree, jnp.arange(tree.capacity)))
    assert np.all(leaves[filled:] == 0)
    assert len(np.unique(leaves[:filled])) > 10  # priorities were set from TD errors, not left at the max
    assert float(jnp.max(leaves)) <= float(tree.max_recorded_priority) + 1e-6


def test_pendulum_sac_config_reaches_the_target_within_50k_steps(tmp_path):
    """configs/pendulum_sac.yaml as shipped: the mean training return reaches -250 within 50k env steps."""
    import yaml

    from orchestrator.config.schema import parse_config
    from orchestrator.iteration.jax_loop import run_jax
    from orchestrator.records.rundir import RunDir

    raw = yaml.safe_load((ROOT / "configs/pendulum_sac.yaml").read_text())
    cfg = parse_config({**raw, "run_dir": str(tmp_path / "run")})
    run = RunDir(tmp_path / "run")
    run_jax(cfg, run, resume=False, show_progress=False)
    metrics = run.metrics()
    assert metrics[-1]["env_steps"] <= 50_000
    solved = [m for m in metrics if m["solved"]]
    assert solved, [round(m["episode_return_mean"]) for m in metrics]
    assert solved[0]["episode_return_mean"] >= -250
    # and it stays learned: the last three iterations' mean return
    assert np.mean([m["episode_return_mean"] for m in metrics[-3:]]) >= -250


def test_sac_shards_on_two_devices_train_as_on_one():
    """Two data shards (own envs and buffers, averaged gradients) give the same parameters on one device and
    on two, and the replicas stay identical."""
    import jax

    from jax_helpers import SAC_TINY
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    cfg = JaxConfig(**{**SAC_TINY, "num_envs": 4, "shards": 2})
    out = []
    for devices in (1, 2):
        engine = Engine(cfg, total_updates=8, seed=0, devices=devices)
        state = engine.init_state()
        for _ in range(2):
            state, _ = engine.run_chunk(state)
        out.append(jax.device_get(state.params))
    for one, two in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_allclose(one, two, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(two[:, 0], two[:, 1])
