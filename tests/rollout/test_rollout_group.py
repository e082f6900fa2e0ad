"""The rollout group over inline engines: an engine that dies takes its actor with it, and the group replaces the
actor on the iteration the engine had loaded and makes the interrupted call again."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from rollout_helpers import max_abs_diff, perturb, publish_like

from orchestrator.workers.rollout_group import RolloutGroup
from rollout.config import EngineConfig
from rollout.engine_proc import wait_gone
from rollout.tasks import AdditionTask
from trainer.batch import TokenDistribution

pytestmark = pytest.mark.slow


def _kill_when_busy(group: RolloutGroup, pid: int, killed: list[int], sig: int = signal.SIGKILL) -> None:
    """Send `sig` to the engine process once its engine has unfinished requests (a generate is in flight)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ray.get(group.engines[0].info.remote(), timeout=30)["unfinished_requests"] > 0:
            os.kill(pid, sig)
            killed.append(pid)
            return


def test_an_inline_engine_killed_mid_generate_is_replaced_on_its_iteration(ray_cluster, tiny_model_dir, tmp_path):
    cfg = EngineConfig(kv_cache_gb=0.125, max_engine_restarts=1, engine_start_timeout_s=400,
                       engine_call_timeout_s=CALL_TIMEOUT_S)
    assert cfg.engine_process == "inline"
    group = RolloutGroup([str(tiny_model_dir)], cfg, dtype="float32", seed=0, deterministic=True)
    try:
        group.wait_started()
        manifest = publish_like(tiny_model_dir, tmp_path / "1", 1, perturb(1, 0.05))
        group.sync(manifest, "reload")
        problems, sampling = AdditionTask(2).problems(0, 5, 48), TokenDistribution()
        reference = group.generate(problems, 8, 48, sampling, 3)
        pid = group.engine_pids()[0]
        assert pid == ray.get(group.engines[0].info.remote(), timeout=30)["engine_pid"]
        killed: list[int] = []
        killer = threading.Thread(target=_kill_when_busy, args=(group, pid, killed))
        killer.start()
        got = group.generate(problems, 8, 48, sampling, 3)
        killer.join()
        assert killed == [pid], "the engine was never seen busy: make the generate longer"
        info = ray.get(group.engines[0].info.remote(), timeout=30)
        assert info["engine_pid"] != pid and info["iteration"] == 1, info
        assert [s.completion_ids for s in got] == [s.completion_ids for s in reference]
        assert max_abs_diff([s.logprobs for s in got], [s.logprobs for s in reference]) <= 1e-5

        # stopped (SIGSTOP) mid-generate: past engine_call_timeout_s the engine is taken for hung, killed (a
        # stopped process dies of SIGKILL) and replaced like a dead one
        stopped: list[int] = []
        pid = info["engine_pid"]
        stopper = threading.Thread(target=_kill_when_busy, args=(group, pid, stopped, signal.SIGSTOP))
        stopper.start()
        started = time.monotonic()
        got = group.generate(problems, 8, 48, sampling, 3)
        stopper.join()
        assert stopped == [pid] and time.monotonic() - started >= CALL_TIMEOUT_S
        info = ray.get(group.engines[0].info.remote(), timeout=30)
        assert info["engine_pid"] != pid and info["iteration"] == 1, info
        assert [s.completion_ids for s in got] == [s.completion_ids for s in reference]
        assert not wait_gone([pid], timeout_s=30), "the stopped engine's process outlived its replacement"
    finally:
        group.shutdown()


CALL_TIMEOUT_S = 10.0  # a generate here takes a few seconds


def test_an_inline_tp2_engine_samples_reloads_and_restarts_in_its_actor(worker_pools, tmp_path):
    """tp=2 inline: the engine core in the actor (a pooled one, which may have run other engines before), one worker
    process per TP rank. A reload and a restart onto the same iteration serve the same samples, and the restart's
    worker processes replace the old ones."""
    from rollout.engine_proc import pids_alive, process_tree
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    model = build_tiny_model(tmp_path / "tp2-model", AdditionTask(1).corpus(),
                             TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=2))
    cfg = EngineConfig(tp=2, kv_cache_gb=0.125, engine_start_timeout_s=400)
    group = RolloutGroup([str(model)], cfg, dtype="float32", seed=0, deterministic=True, pool=worker_pools.engines)
    try:
        group.wait_started()
        pid = group.engine_pids()[0]
        workers = [p for p in process_tree(pid) if p != pid]
        assert len(workers) >= 2, "expected a worker process per TP rank"
        problems, sampling = AdditionTask(1).problems(0, 1, 8), TokenDistribution()
        base = group.generate(problems, 4, 8, sampling, 3)
        manifest = publish_like(model, tmp_path / "1", 1, perturb(1, 0.05))
        group.sync(manifest, "reload")
        reloaded = group.generate(problems, 4, 8, sampling, 3)
        group.sync(manifest, "restart")
        restarted = group.generate(problems, 4, 8, sampling, 3)
        assert group.engine_pids() == [pid] and not pids_alive(workers)
        assert [s.completion_ids for s in reloaded] != [s.completion_ids for s in base]
        assert [s.completion_ids for s in restarted] == [s.completion_ids for s in reloaded]
        assert max_abs_diff([s.logprobs for s in restarted], [s.logprobs for s in reloaded]) <= 1e-5
    finally:
        group.shutdown()
