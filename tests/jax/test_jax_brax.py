"""Brax environments through the Environment protocol (trainer/jax/envs.py BraxEnv), configs/brax_pendulum.yaml
solving Brax's inverted pendulum and configs/brax_hopper.yaml learning to hop."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300, method="thread")
ROOT = Path(__file__).resolve().parents[2]


def test_brax_env_reports_the_time_limit_as_truncation():
    import jax
    import jax.numpy as jnp

    from trainer.jax.envs import Box, auto_reset_step, make_env, reset_slot

    env = make_env("brax/inverted_pendulum", backend="generalized", episode_length=3)
    assert env.observation_shape == (4,) and env.action_space == Box((1,), -1.0, 1.0)
    obs, slot = reset_slot(env, jax.random.PRNGKey(0))
    step = jax.jit(lambda s, k: auto_reset_step(env, k, k, s, jnp.zeros((1,))))
    outs = []
    for i in range(3):  # a pole started within 0.01 rad of upright does not fall in 3 steps of no force
        out = step(slot, jax.random.PRNGKey(i + 1))
        slot = out.slot
        outs.append(out)
    assert [bool(o.done) for o in outs] == [False, False, True]
    assert bool(outs[-1].truncated)  # cut by the limit, not ended by the task
    assert float(outs[-1].finished_return) == 3.0 and int(outs[-1].finished_length) == 3
    assert int(slot.state[1]) == 0  # the step counter restarted with the new episode
    assert np.abs(np.asarray(outs[-1].obs) - np.asarray(outs[-1].final_obs)).max() > 0  # reset obs != last obs


def test_unknown_brax_env_is_named():
    from trainer.jax.envs import make_env

    with pytest.raises(ValueError, match=r"unknown Brax environment 'invrted_pendulum'.*inverted_pendulum"):
        make_env("brax/invrted_pendulum")


def test_brax_pendulum_config_solves_the_task(tmp_path):
    """configs/brax_pendulum.yaml as shipped: SAC reaches the solved return (950 of 1000) and keeps it."""
    import yaml

    from orchestrator.config.schema import parse_config
    from orchestrator.iteration.jax_loop import run_jax
    from orchestrator.records.rundir import RunDir

    raw = yaml.safe_load((ROOT / "configs/brax_pendulum.yaml").read_text())
    cfg = parse_config({**raw, "run_dir": str(tmp_path / "run")})
    run = RunDir(tmp_path / "run")
    run_jax(cfg, run, resume=False, show_progress=False)
    returns = [m["episode_return_mean"] for m in run.metrics()]
    assert any(m["solved"] for m in run.metrics()), returns
    assert returns[-1] is not None and returns[-1] >= 950, returns


def test_brax_hopper_config_learns_to_hop(tmp_path):
    """configs/brax_hopper.yaml (PPO with observation normalisation and reward scaling on Brax's hopper), cut to
    its first ~1M env steps: a locomotion task through the Environment protocol (11 observations, 3 actuators;
    episodes end by the task, the hopper falling, long before the 1000-step limit; finite losses) whose mean
    training return climbs from ~210 in the first iteration to above 380 (measured here: 422 at 983k steps; the
    same run without normalisation and scaling: 268)."""
    import math

    import yaml

    from orchestrator.config.schema import parse_config
    from orchestrator.iteration.jax_loop import run_jax
    from orchestrator.records.rundir import RunDir
    from trainer.jax.envs import make_env

    raw = yaml.safe_load((ROOT / "configs/brax_hopper.yaml").read_text())
    env = make_env(raw["jax"]["env"], **raw["jax"]["env_kwargs"])
    assert env.observation_shape == (11,) and env.action_space.shape == (3,)
    cfg = parse_config({**raw, "iterations": 6, "run_dir": str(tmp_path / "run")})
    run = RunDir(tmp_path / "run")
    run_jax(cfg, run, resume=False, show_progress=False)
    metrics = run.metrics()
    returns = [m["episode_return_mean"] for m in metrics]
    assert metrics[0]["episodes"] > 0 and metrics[0]["episode_length_mean"] < 200  # random hoppers fall
    assert all(math.isfinite(m[k]) for m in metrics for k in ("pg_loss", "value_loss", "entropy")), metrics[-1]
    assert metrics[-1]["env_steps"] <= 1_000_000
    assert returns[-1] >= 380 and returns[-1] >= 1.6 * returns[0], returns
