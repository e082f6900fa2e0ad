"""Session-wide fixtures: one local Ray cluster, one tiny HF model, one rollout engine actor.

An engine actor costs 10-15 s to start here (importing vLLM; 25-80 s with the engine core in a child process),
so every test module shares the same actor. A module that syncs other weights into `rollout_engine` syncs the
weights of `tiny_model_dir` back before it ends.
"""
from __future__ import annotations

import os

import pytest

# Read by Ray when the cluster starts; set before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray's log monitor looks for new log files every 0.1 s until there are 1000 of them, every 0.5 s after: the
# session's clusters (a few hundred worker logs each) spent 112 CPU-s of a 39-minute suite in it
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")


_SHM = "/dev/shm"
_SHM_PREFIXES = ("psm_", "sem.mp-", "tide-test-")
_SHM_BEFORE = pytest.StashKey[set]()


def _shm_in_use() -> set[str]:
    """Names under /dev/shm that some live process maps or holds open."""
    from rollout.engine_proc import engine_segments

    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    used = {os.path.basename(p) for p in engine_segments(pids)}
    for pid in pids:  # engine_segments only reports vLLM's own prefixes; semaphores are named sem.mp-*
        try:
            with open(f"/proc/{pid}/maps") as f:
                used |= {os.path.basename(l.split()[-1]) for l in f if "/dev/shm/sem." in l}
        except OSError:
            continue
    return used


# The suite runs in two pytest-xdist workers (`-n 2 --dist worksteal`, the README's test command): measured alone
# it keeps 1.34 of 2 cores busy on average (process starts, waits on engines and containers). OpenMP threads
# (torch's, vLLM's CPU kernels) wait for work passively: spinning, they take the cores the test's other
# processes (driver, ranks, engine) need -- a CLI run was 10-20% faster so even alone, and more beside the
# other worker.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _controller(session) -> bool:
    """True in the process that sees the whole session: the only one without xdist, the controller with it."""
    return not hasattr(session.config, "workerinput")


def pytest_sessionstart(session):
    if _controller(session):
        session.config.stash[_SHM_BEFORE] = set(os.listdir(_SHM))


def pytest_sessionfinish(session):
    """Processes killed on purpose (SIGKILLed drivers and engines) cannot unlink their shared-memory segments.
    After the whole session (every worker done), remove what appeared during it that no live process still uses;
    what existed before the session is never touched. Run by the controller only: a worker that finishes first
    would take the other's segments, which nothing maps between two phases of a run."""
    if not _controller(session) or _SHM_BEFORE not in session.config.stash:
        return
    import shutil

    before = session.config.stash[_SHM_BEFORE]
    in_use = _shm_in_use()
    for name in set(os.listdir(_SHM)) - before:
        if name.startswith(_SHM_PREFIXES) and name not in in_use:
            path = os.path.join(_SHM, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """`built_once(name, build)`: `build(path)` run once per test session for both xdist workers (`-n 2`, the
    README's test command) into a shared directory, returned to each: the first worker to ask builds it under a
    lock, the other waits and reads it. A module-scoped fixture alone is built by each worker that runs one of the
    module's tests (worksteal spreads them). A failed build is retried by the next to ask. Only for results that
    tests read and never change."""
    import shutil
    from pathlib import Path

    from filelock import FileLock

    base = Path(tmp_path_factory.getbasetemp())
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, above each worker's

    def get(name: str, build) -> Path:
        path, done = root / name, root / f"{name}.built"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)  # a build that failed half-way
                path.mkdir()
                build(path)
                done.touch()
        return path

    return get


@pytest.fixture(scope="session")
def ray_cluster():
    """A fresh local Ray cluster for the whole session (never joins another one); yields {"address": gcs}."""
    import ray

    if ray.is_initialized():  # started by someone else in this process: share it, don't stop it
        yield {"address": ray.get_runtime_context().gcs_address}
        return
    # 4 GPUs declared, none real: tests/orchestrator/test_placement.py reserves them as a GPU run would; nothing
    # else asks for a GPU. No idle workers started ahead of the actors: the suite keeps both cores busy, and an idle
    # cluster took 2.4 CPU-s per 30 s with them, 1.4 without (measured twice each).
    ctx = ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, namespace="tide_test",
                   log_to_driver=True, configure_logging=False,
                   _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
    try:
        yield {"address": ctx.address_info["gcs_address"]}
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def rank_pool(ray_cluster):
    """Trainer-rank processes shared by every TrainerGroup a test builds (`TrainerGroup(spec, pool=rank_pool)`):
    a group's start here is mostly its ranks importing torch and Megatron, which a pooled rank did once."""
    from orchestrator.workers.trainer_group import RankPool

    pool = RankPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def worker_pools(rank_pool):
    """Trainer ranks and rollout engines kept between the runs a test drives in this process
    (tests/integration/run_helpers.py `run_here`): a run's start here is mostly its ranks importing torch and
    Megatron and its engines vLLM, which a pooled process did once."""
    from orchestrator.workers.pools import EnginePool, WorkerPools

    pools = WorkerPools(ranks=rank_pool, engines=EnginePool())
    try:
        yield pools
    finally:
        pools.engines.close()  # the ranks are rank_pool's to close


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 HF directory (random init, float32). head_dim is 32: vLLM's CPU attention kernels
    support head sizes 32, 64, 80, ... only."""
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=1)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", AdditionTask(1).corpus(), spec)


@pytest.fixture(scope="session")
def rollout_engine(ray_cluster, tiny_model_dir):
    """A RolloutEngine Ray actor on `tiny_model_dir` (TP=1, float32, prefix caching on), wrapped like the
    orchestrator wraps it (max_concurrency=3: a sync, or info/engine_pid, answer while a generate runs)."""
    import ray

    from rollout.config import EngineConfig
    from rollout.engine import RolloutEngine

    cfg = EngineConfig(kv_cache_gb=0.125, max_engine_restarts=2, engine_start_timeout_s=400)
    actor = ray.remote(num_cpus=0, max_concurrency=3)(RolloutEngine).remote(str(tiny_model_dir), cfg)
    ray.get(actor.info.remote(), timeout=600)  # the constructor ran: the engine is up
    try:
        yield actor
    finally:
        try:
            ray.get(actor.shutdown.remote(process_ends=True), timeout=120)
        finally:
            ray.kill(actor)
