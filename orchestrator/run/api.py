"""tide from Python: `run` and `resume` do what `tide run` and `tide resume` do, in this process, raising where the
CLI exits (ConfigError, TaskDataError, UsageError and RunDirBusy are its exit 2; anything else a fault, exit 1).
Given `WorkerPools` (orchestrator/workers/pools.py), a process that drives runs one after another (a sweep, a
benchmark's repeats, the test suite) starts its trainer ranks and rollout engines once instead of once per run.

    from orchestrator.run import api
    from orchestrator.workers.pools import WorkerPools

    pools = WorkerPools()
    for lr in (1e-3, 3e-4):
        api.run("configs/quickstart.yaml", [f"trainer.lr={lr}"], run_dir=f"runs/lr{lr}", pools=pools)
    pools.close()

Ray must be initialised in the process first for pools (they are Ray actors): `ray.init()`, or `ray.init(address)`
to join a cluster; the runs then use that connection, whatever their `ray:` section says.
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config.schema import ConfigError, TideConfig, dump_config, load_config, parse_overrides
from orchestrator.records.rundir import RunDir
from rollout.tasks import TaskDataError

if TYPE_CHECKING:  # imports Ray: not for the CLI's commands that start nothing
    from orchestrator.workers.pools import WorkerPools


class UsageError(ValueError):
    """A request refused before anything runs that no config field names (a run directory that already holds a
    run, or holds none to resume)."""


def run(config: str | Path, overrides: Sequence[str] = (), run_dir: str | Path | None = None,
        pools: WorkerPools | None = None) -> RunDir:
    """Start a run from the YAML `config` with `key.path=value` overrides and drive it to its end; its directory."""
    cfg, held = prepare_run(Path(config), overrides, run_dir)
    return _drive_held(cfg, held, False, pools)


def resume(run_dir: str | Path, iterations: int | None = None, pools: WorkerPools | None = None) -> RunDir:
    """Continue a killed or finished run from its newest complete checkpoint (to `iterations`, when given)."""
    cfg, held = prepare_resume(Path(run_dir), iterations)
    return _drive_held(cfg, held, True, pools)


def prepare_run(config: Path, overrides: Sequence[str], run_dir: str | Path | None) -> tuple[TideConfig, RunDir]:
    """The config with its overrides and the run directory, taken for this process."""
    cfg = load_config(config, parse_overrides(list(overrides)))
    path = Path(run_dir) if run_dir is not None else Path(cfg.run_dir or Path("runs") / cfg.name)
    run = RunDir(path)
    run.hold()
    if run.latest_checkpoint() is not None:
        run.let_go()
        raise UsageError(f"{path} already holds a run with checkpoints: `tide resume {path}` continues it, or "
                         f"choose another --run-dir")
    return cfg, run


def prepare_resume(run_dir: Path, iterations: int | None) -> tuple[TideConfig, RunDir]:
    """The run's recorded config (extended to `iterations`) and its directory, taken for this process."""
    if not (run_dir / "config.yaml").is_file():
        raise UsageError(f"{run_dir} is not a run directory (no config.yaml)")
    overrides = None
    if iterations is not None:
        done = RunDir(run_dir).latest_checkpoint()
        at = RunDir.read_run_state(done)["iteration"] if done else 0
        if iterations <= at:
            raise UsageError(f"--iterations {iterations}: {run_dir} already has a checkpoint at iteration {at}")
        overrides = {"iterations": iterations}
    cfg = load_config(run_dir / "config.yaml", overrides)
    run = RunDir(run_dir)
    run.hold()
    return cfg, run


def _drive_held(cfg: TideConfig, run: RunDir, resume: bool, pools: WorkerPools | None) -> RunDir:
    try:
        if pools is not None:
            import ray

            if not ray.is_initialized():  # the run would connect, and end the connection its pools' actors live on
                raise UsageError("worker pools outlive runs on this process's Ray connection: ray.init() (or "
                                 "ray.init(address) to join a cluster) before the first run")
        execute(cfg, run, resume, pools)
    finally:
        run.let_go()
    return run


def execute(cfg: TideConfig, run: RunDir, resume: bool, pools: WorkerPools | None = None) -> None:
    """Run (or resume) and record how it ended in status.json. A run that stops on its input before anything
    ran (a bad row, a reward function that cannot be imported: exit 2) leaves no directory behind when it made
    it; any other failure leaves status.json saying `failed` and why."""
    try:
        drive(cfg, run, resume, pools)
    except BaseException as e:
        if (isinstance(e, (ConfigError, TaskDataError)) and run.created and not run.metrics()
                and run.latest_checkpoint() is None):
            shutil.rmtree(run.path, ignore_errors=True)
        else:
            run.end_status(e)
        raise
    run.end_status()


def drive(cfg: TideConfig, run: RunDir, resume: bool, pools: WorkerPools | None = None) -> None:
    try:
        if cfg.logging.wandb is not None:
            from orchestrator.records.wandb_log import WandbLog

            run.attach(WandbLog(run.path, cfg.logging.wandb, cfg.name, cfg.model_dump(mode="json")))
        if cfg.engine == "jax":
            from orchestrator.iteration.jax_loop import run_jax

            run.config_file.write_text(dump_config(cfg))
            run_jax(cfg, run, resume)
            return
        from rollout.engine_proc import gc_paused

        with gc_paused():
            from transformers import AutoTokenizer  # noqa: F401  (Session.open's; most of the driver's imports)

            from orchestrator.iteration.loop import run_iterations
            from orchestrator.iteration.session import Session

        session, interrupted = Session.open(cfg, run, resume, pools), False
        try:
            run_iterations(session)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            session.close(interrupted)
    finally:
        run.close()
