"""run_jax end to end: run directory records, and exact resume after a simulated kill."""
from __future__ import annotations

import numpy as np
import pytest

from jax_helpers import IMPALA_TINY, SAC_TINY, TINY

pytestmark = pytest.mark.timeout(240, method="thread")


# SAC with prioritized replay and a buffer that wraps around during the run: the checkpoint must hold the
# transitions, the write position and the sum tree for the resumed run to sample the same batches.
VARIANTS = {
    "ppo_one_seed": {**TINY, "seeds": 1},
    # with the running observation and reward statistics, which the checkpoint must carry too
    "ppo_two_seeds_two_devices_normalised": {**TINY, "seeds": 2, "normalize_observations": True, "scale_rewards": True},
    "sac_prioritized_two_seeds": {**SAC_TINY, "seeds": 2, "sac": {**SAC_TINY["sac"], "prioritized": True}},
    "impala": IMPALA_TINY,
}


def _cfg(name: str, run_dir, variant: str):
    from orchestrator.config.schema import parse_config

    return parse_config({"name": name, "engine": "jax", "seed": 3, "iterations": 4, "save_every": 2,
                         "keep_checkpoints": 3, "run_dir": str(run_dir), "jax": VARIANTS[variant]})


def _final_state(cfg, run):
    from orchestrator.iteration.jax_loop import STATE_DIR
    from trainer.jax.engine import Engine

    engine = Engine(cfg.jax, total_updates=cfg.iterations * cfg.jax.updates_per_iteration, seed=cfg.seed)
    return engine.restore(run.latest_checkpoint() / STATE_DIR)


# Two seeds take both of the test process's host devices: the checkpoint gathers them, resume re-spreads them.
@pytest.fixture(scope="module", params=list(VARIANTS))
def runs(request, tmp_path_factory):
    from orchestrator.iteration.jax_loop import run_jax
    from orchestrator.records.rundir import RunDir

    base = tmp_path_factory.mktemp("jaxruns")
    full = RunDir(base / "full")
    cfg_full = _cfg("full", full.path, request.param)
    run_jax(cfg_full, full, resume=False, show_progress=False)

    cut = RunDir(base / "cut")
    cfg_cut = _cfg("cut", cut.path, request.param)
    run_jax(cfg_cut, cut, resume=False, stop_after=3, show_progress=False)  # killed after iteration 3
    cut_metrics_before = cut.metrics()
    run_jax(cfg_cut, cut, resume=True, show_progress=False)
    return cfg_full, full, cut, cut_metrics_before


def test_run_directory_records(runs):
    cfg, full, _, _ = runs
    metrics = full.metrics()
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert all("episode_return_mean" in m and m["env_steps"] > 0 for m in metrics)
    phases = [(t["iteration"], t["phase"]) for t in full.timings()]
    assert phases[0] == (1, "compile")
    assert [i for i, p in phases if p == "train"] == [1, 2, 3, 4]
    assert [i for i, p in phases if p == "checkpoint"] == [2, 4]
    assert full.latest_checkpoint().name.endswith("0000004")


def test_resume_is_exact(runs):
    import jax

    cfg, full, cut, before = runs
    assert [m["iteration"] for m in before] == [1, 2, 3]
    assert [m["iteration"] for m in cut.metrics()] == [1, 2, 3, 4]  # iteration 3 recorded once
    a, b = _final_state(cfg, full), _final_state(cfg, cut)
    assert len(jax.tree.leaves(a.params)[0].sharding.device_set) == cfg.jax.seeds  # one seed per device
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if cfg.jax.normalize_observations:  # statistics of every step so far are part of what was compared
        assert float(np.asarray(a.obs_moments.count).min()) == cfg.jax.num_envs * cfg.jax.num_steps * \
            cfg.jax.updates_per_iteration * cfg.iterations
    if cfg.jax.algorithm == "sac":  # the buffer wrapped around and is part of what was compared
        assert int(np.asarray(a.env_steps).min()) > cfg.jax.sac.buffer_size
        assert np.asarray(a.buffer.is_full).all()
    # the resumed run's iteration 3 and 4 metrics equal the uninterrupted run's
    loss = {"ppo": "pg_loss", "impala": "pg_loss", "sac": "critic_loss"}[cfg.jax.algorithm]
    for m_full, m_cut in zip(full.metrics()[2:], cut.metrics()[2:]):
        assert m_full["episode_return_mean"] == m_cut["episode_return_mean"]
        assert m_full[loss] == m_cut[loss]
