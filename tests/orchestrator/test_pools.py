"""Worker pools (orchestrator/workers/pools.py): a rollout engine's process reused by a second rollout group starts
its engine as a new process would: the cores the first engine was bound to (placement.mode disaggregated, or a
config's own binding) do not carry over (nor its environment, or vLLM's cache of it:
tests/rollout/test_reusable_engine.py)."""
from __future__ import annotations

import os

import pytest
import ray

from orchestrator.workers.rollout_group import RolloutGroup
from rollout.config import EngineConfig
from rollout.tasks import AdditionTask
from tests.integration.run_helpers import threads_cpus
from trainer.batch import TokenDistribution

pytestmark = pytest.mark.slow


def test_a_pooled_engine_process_starts_its_next_engine_on_the_next_configs_cores(worker_pools, tiny_model_dir):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores to bind an engine to one of them")
    pool = worker_pools.engines  # the session's: a process that may have served other runs' engines already
    problems, sampling = AdditionTask(1).problems(0, 2, 4), TokenDistribution()
    # bound to the first core, every thread of the process (vLLM's OpenMP threads by its own binding)
    first = EngineConfig(kv_cache_gb=0.125, extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(cpus[0])})
    group = RolloutGroup([str(tiny_model_dir)], first, dtype="float32", seed=0, deterministic=True, pool=pool)
    try:
        group.wait_started()
        pid = group.engine_pids()[0]
        assert threads_cpus(pid) == {(cpus[0],)}
        assert len(group.generate(problems, 2, 4, sampling, 0)) == 2 * len(problems)
    finally:
        group.shutdown()
    # the same process, its next engine on every core (the default binding), none of its threads left on one
    group = RolloutGroup([str(tiny_model_dir)], EngineConfig(kv_cache_gb=0.125), dtype="float32", seed=0,
                         deterministic=True, pool=pool)
    try:
        group.wait_started()
        assert group.engine_pids() == [pid]
        assert threads_cpus(pid) == {tuple(cpus)}
        assert len(group.generate(problems, 2, 4, sampling, 0)) == 2 * len(problems)
    finally:
        group.shutdown()
    engine = pool.take()  # handed back, stopped
    pool.give_back(engine)
    assert ray.get(engine.info.remote(), timeout=60)["engine_pid"] is None
