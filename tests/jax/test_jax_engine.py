"""The jitted engine: vmapped seeds, 1 vs 2 devices, other environments (continuous, MinAtar, a user env)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_helpers import tiny

pytestmark = pytest.mark.timeout(180, method="thread")


def _train(cfg, chunks: int, devices: int | None = None, seed: int = 0):
    from trainer.jax.engine import Engine, summarize

    engine = Engine(cfg, total_updates=chunks * cfg.updates_per_iteration, seed=seed, devices=devices)
    state = engine.init_state()
    summaries = []
    for _ in range(chunks):
        state, metrics = engine.run_chunk(state)
        summaries.append(summarize(metrics))
    return engine, state, summaries


def test_two_host_devices_present():
    assert jax.device_count() == 2, "tests/jax/conftest.py must set XLA_FLAGS before jax is imported"


def test_one_vs_two_devices_same_parameters():
    from trainer.jax.engine import flat_params

    cfg = tiny(num_envs=8, shards=2)
    e1, s1, _ = _train(cfg, chunks=2, devices=1)
    e2, s2, _ = _train(cfg, chunks=2, devices=2)
    assert e1.mesh is None and e2.mesh is not None
    assert len(s2.params.sharding.device_set) == 2
    p1, p2 = flat_params(s1), flat_params(s2)
    np.testing.assert_array_equal(p1[:, 0], p1[:, 1])  # shards hold identical replicas
    np.testing.assert_array_equal(p2[:, 0], p2[:, 1])
    assert np.abs(p1 - flat_params(_init(cfg))).max() > 1e-4  # it did train
    np.testing.assert_allclose(p1, p2, atol=1e-5, rtol=1e-5)


def test_seeds_spread_over_devices_same_parameters():
    """Seeds go to devices first (no communication): 2 seeds on 2 devices train as on one."""
    from trainer.jax.engine import flat_params

    cfg = tiny(seeds=2)
    e2, s2, _ = _train(cfg, chunks=2)  # devices=None: the seeds take both devices
    e1, s1, _ = _train(cfg, chunks=2, devices=1)
    assert e1.mesh is None and dict(e2.mesh.shape) == {"seed": 2, "data": 1}
    assert len(s2.params.sharding.device_set) == 2
    p1, p2 = flat_params(s1), flat_params(s2)
    assert np.abs(p1[0] - p1[1]).max() > 1e-3  # independent agents
    np.testing.assert_allclose(p1, p2, atol=1e-5, rtol=1e-5)


def test_device_layout_prefers_seeds_and_rejects_uneven_splits():
    from trainer.jax.engine import pick_devices

    assert pick_devices(tiny(seeds=2, num_envs=8, shards=2)) == (2, 1)
    assert pick_devices(tiny(seeds=3, num_envs=8, shards=2)) == (1, 2)
    assert pick_devices(tiny(seeds=3)) == (1, 1)
    assert pick_devices(tiny(seeds=2), devices=1) == (1, 1)
    with pytest.raises(ValueError, match="devices"):
        tiny(seeds=3, devices=2)


def _init(cfg):
    from trainer.jax.engine import Engine

    return Engine(cfg, total_updates=1, seed=0, devices=1).init_state()


def test_vmapped_seeds_match_single_runs():
    from trainer.jax.engine import flat_params

    _, many, summaries = _train(tiny(seeds=3), chunks=2)
    _, one, _ = _train(tiny(seeds=1), chunks=2)
    p_many, p_one = flat_params(many), flat_params(one)
    assert p_many.shape[0] == 3
    np.testing.assert_allclose(p_many[0], p_one[0], atol=1e-5, rtol=1e-5)
    assert np.abs(p_many[1] - p_many[2]).max() > 1e-3  # independent agents
    assert len(summaries[-1]["episode_return_mean_per_seed"]) == 3


def test_continuous_actions_pendulum():
    _, state, summaries = _train(tiny(env="Pendulum-v1", num_steps=32), chunks=1)
    assert np.isfinite(summaries[-1]["pg_loss"]) and np.isfinite(summaries[-1]["value_loss"])
    assert np.isfinite(np.asarray(state.params)).all()


def test_minatar_breakout_runs():
    _, _, summaries = _train(tiny(env="Breakout-MinAtar", num_steps=32), chunks=1)
    assert np.isfinite(summaries[-1]["entropy"])


def test_user_environment_learns():
    cfg = tiny(env="toy_env:make", num_envs=8, num_steps=32, updates_per_iteration=10, epochs=4, lr=3e-3,
               anneal_lr=False, gamma=0.9)
    _, _, summaries = _train(cfg, chunks=3)
    first, last = summaries[0]["episode_length_mean"], summaries[-1]["episode_length_mean"]
    assert last < first and summaries[-1]["episode_return_mean"] > 0.9  # walks right, fast


def test_engine_lowering_unrolls_threefry_with_the_same_bits():
    """The engine lowers jax.random's threefry unrolled (no while loop per draw on CPU); the draws are the bits
    JAX's default lowering gives, and the default is untouched for everything else."""
    from trainer.jax.lowering import lower

    def draws(key):
        a, b = jax.random.split(key)
        return (jax.random.uniform(a, (7, 3)), jax.random.normal(b, (5,)), jax.random.randint(b, (4,), 0, 100),
                jax.random.split(a, (3, 2)), jax.random.permutation(a, 10))

    key = jax.random.PRNGKey(3)
    default = jax.jit(draws).lower(key)
    unrolled = lower(jax.jit(draws), key)
    assert "stablehlo.while" in default.as_text()
    assert "stablehlo.while" not in unrolled.as_text()
    for x, y in zip(jax.tree.leaves(default.compile()(key)), jax.tree.leaves(unrolled.compile()(key))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert "stablehlo.while" in jax.jit(lambda k: draws(k)).lower(key).as_text()


def test_cpu_matmul_picks_the_library_the_products_run_on():
    """`cpu_matmul: eigen` compiles the products as XLA dots, `ynnpack` as YNNPACK fusions (XLA:CPU's default);
    the same products either way."""
    from trainer.jax import lowering
    from trainer.jax.config import JaxConfig

    x = jax.random.normal(jax.random.PRNGKey(0), (256, 128))
    w = jax.random.normal(jax.random.PRNGKey(1), (128, 128)) / 16
    mlp = jax.jit(lambda x, w: jax.nn.relu(x @ w) @ w)
    eigen, ynn = (lowering.compile(mlp, x, w, cpu_matmul=m) for m in ("eigen", "ynnpack"))
    assert "ynn_fusion" in ynn.as_text() and "ynn_fusion" not in eigen.as_text()
    np.testing.assert_allclose(np.asarray(eigen(x, w)), np.asarray(ynn(x, w)), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cpu_matmul"):
        lowering.compiler_options("mkl")
    assert JaxConfig().cpu_matmul == "ynnpack"
    with pytest.raises(ValueError, match="cpu_matmul"):
        JaxConfig(cpu_matmul="mkl")
