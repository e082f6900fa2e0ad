"""`tide run CONFIG`, `tide resume RUN_DIR`, `tide inspect RUN_DIR`, `tide export RUN_DIR OUT`."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from orchestrator.config import ConfigError, TideConfig, dump_config, load_config
from orchestrator.rundir import RunDir
from rollout.tasks import TaskDataError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tide: RL post-training with Megatron-core, vLLM, Mooncake and a JAX engine.")


def _fail(msg: str, code: int) -> None:
    typer.echo(msg, err=True)
    raise typer.Exit(code)


def _execute(cfg: TideConfig, run: RunDir, resume: bool) -> None:
    try:
        if cfg.logging.wandb is not None:
            from orchestrator.wandb_log import WandbLog

            run.attach(WandbLog(run.path, cfg.logging.wandb, cfg.name, cfg.model_dump(mode="json")))
        if cfg.engine == "jax":
            from orchestrator.jax_loop import run_jax

            run.config_file.write_text(dump_config(cfg))
            run_jax(cfg, run, resume)
            return
        from orchestrator.loop import run_iterations
        from orchestrator.session import Session

        session = Session.open(cfg, run, resume)
        try:
            run_iterations(session)
        finally:
            session.close()
    finally:
        run.close()


@app.command()
def run(config: Path = typer.Argument(..., help="YAML config"),
        run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="default: runs/<name>")) -> None:
    """Start a run from a YAML config."""
    try:
        cfg = load_config(config)
    except ConfigError as e:
        _fail(str(e), 2)
    path = run_dir or Path(cfg.run_dir or Path("runs") / cfg.name)
    run = RunDir(path)
    if run.latest_checkpoint() is not None:
        _fail(f"{path} already holds a run with checkpoints: `tide resume {path}` continues it, "
              f"or choose another --run-dir", 2)
    _guarded(lambda: _execute(cfg, run, resume=False))


@app.command()
def resume(run_dir: Path = typer.Argument(..., help="a run directory written by `tide run`"),
           iterations: Optional[int] = typer.Option(None, "--iterations", help="extend (or shorten) the run to N "
                                                    "iterations; the resolved config records the new length")) -> None:
    """Continue a killed or finished run from its newest complete checkpoint.

    With --iterations N a finished run goes on to iteration N, exactly as a run started with N iterations
    would have (learning-rate schedules that decay over the run are stretched to the new length, so with
    those only the iterations up to the checkpoint are shared)."""
    if not (run_dir / "config.yaml").is_file():
        _fail(f"{run_dir} is not a run directory (no config.yaml)", 2)
    overrides = None
    if iterations is not None:
        done = RunDir(run_dir).latest_checkpoint()
        at = RunDir.read_run_state(done)["iteration"] if done else 0
        if iterations <= at:
            _fail(f"--iterations {iterations}: {run_dir} already has a checkpoint at iteration {at}", 2)
        overrides = {"iterations": iterations}
    try:
        cfg = load_config(run_dir / "config.yaml", overrides)
    except ConfigError as e:
        _fail(str(e), 2)
    _guarded(lambda: _execute(cfg, RunDir(run_dir), resume=True))


@app.command()
def inspect(run_dir: Path = typer.Argument(..., help="a run directory"),
            plot: bool = typer.Option(True, help="write RUN_DIR/timings.png")) -> None:
    """Per-phase timing table and a plot of phase time and reward per iteration."""
    from orchestrator.inspect import inspect_run

    if not (run_dir / "timings.jsonl").is_file():
        _fail(f"{run_dir} has no timings.jsonl", 2)
    inspect_run(RunDir(run_dir), plot=plot)


@app.command()
def export(run_dir: Path = typer.Argument(..., help="a run directory"),
           out: Path = typer.Argument(..., help="the Hugging Face directory to write"),
           iteration: Optional[int] = typer.Option(None, "--iteration", help="a kept checkpoint (default: newest)"),
           verify: bool = typer.Option(False, "--verify", help="load the export with transformers and check its "
                                       "logits against Megatron's (float32: to 1e-4)"),
           ) -> None:
    """Write a kept checkpoint as a Hugging Face model directory (safetensors, config, tokenizer), from any
    trainer layout, in this process: no Ray, no vLLM. A finished run already holds its last iteration in
    RUN_DIR/hf."""
    from orchestrator.export import ExportMismatch, export_checkpoint

    if not (run_dir / "config.yaml").is_file():
        _fail(f"{run_dir} is not a run directory (no config.yaml)", 2)
    try:
        result = export_checkpoint(RunDir(run_dir), out, iteration, verify)
    except FileNotFoundError as e:
        _fail(f"error: {e}", 2)
    except ExportMismatch as e:
        _fail(f"error: {e}", 1)
    typer.echo(f"wrote {result.path} (iteration {result.iteration})")
    if result.logit_diff is not None:
        typer.echo(f"verified: max |logit difference| transformers vs Megatron {result.logit_diff:.2e}, "
                   f"max |log-prob difference| {result.logprob_diff:.2e}")


def _guarded(fn) -> None:
    # SIGTERM (a scheduler's preemption, `kill`) unwinds like Ctrl-C, so the run's engines, trainer ranks,
    # sandbox and /dev/shm copies are released by the same `finally` blocks instead of being orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        fn()
    except KeyboardInterrupt:
        _fail("interrupted; `tide resume` continues from the newest checkpoint", 130)
    except (ConfigError, TaskDataError) as e:  # found at start-up, before anything ran
        _fail(str(e), 2)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        _fail(f"error: {type(e).__name__}: {e}", 1)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
