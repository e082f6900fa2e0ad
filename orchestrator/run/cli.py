"""`tide run CONFIG [key.path=value ...]`, `tide resume RUN_DIR` (either with --max-restarts N), `tide inspect
RUN_DIR`, `tide export RUN_DIR OUT`, `tide config show CONFIG [key.path=value ...]`, `tide config reference`,
`tide plan CONFIG`, `tide --version`."""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn, Optional

import typer

from orchestrator.config.schema import ConfigError, TideConfig, dump_config, load_config, parse_overrides
from orchestrator.records.rundir import RunDir
from orchestrator.records.run_lock import RunDirBusy
from orchestrator.run import api

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tide: RL post-training with Megatron-core, vLLM, Mooncake and a JAX engine.")
config_app = typer.Typer(no_args_is_help=True, help="Print a resolved config, or the reference of every key.")
app.add_typer(config_app, name="config")

OVERRIDES_HELP = ("key.path=value settings applied on top of the file, values read as YAML: trainer.lr=5e-4 "
                  "iterations=3 'rollout.stop=[\"\\n\"]' rewards.0.weight=0.5")


def _fail(msg: str, code: int) -> None:
    typer.echo(msg, err=True)
    raise typer.Exit(code)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"tide {version('tide')}")
        raise typer.Exit()


@app.callback()
def _options(_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                           help="Print tide's version and exit.")) -> None:
    """tide: RL post-training with Megatron-core, vLLM, Mooncake and a JAX engine."""


def _load(config: Path, overrides: list[str] | None) -> TideConfig:
    """The config file with its overrides, or exit 2 naming what is wrong."""
    try:
        return load_config(config, parse_overrides(overrides or []))
    except ConfigError as e:
        _fail(str(e), 2)


MAX_RESTARTS = typer.Option(0, "--max-restarts", min=0, help="restart the run from its newest checkpoint after "
                            "up to N faults (a trainer rank, an engine that cannot be replaced or the Ray head "
                            "dying: exit 1 or a signal); config and data errors are never retried")
RESTART_BACKOFF = typer.Option(10.0, "--restart-backoff", min=0, help="seconds before the first restart, doubling "
                               "with each further one")


def _supervised(run: RunDir, argv: list[str], max_restarts: int, backoff_s: float) -> None:
    from orchestrator.run.supervisor import Supervisor

    raise typer.Exit(Supervisor(run.path, max_restarts, backoff_s, lock_fd=run.lock_fd).run(argv))


@app.command()
def run(config: Path = typer.Argument(..., help="YAML config"),
        overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
        run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="default: runs/<name> (relative to the "
                                               "working directory)"),
        max_restarts: int = MAX_RESTARTS, restart_backoff: float = RESTART_BACKOFF) -> None:
    """Start a run from a YAML config. Relative paths in it resolve against its directory; RUN_DIR/config.yaml
    records the resolved config, overrides included."""
    try:
        cfg, run = api.prepare_run(config, overrides or [], run_dir)
    except (ConfigError, api.UsageError, RunDirBusy) as e:
        _fail(str(e), 2)
    if max_restarts:
        _supervised(run, ["run", str(config), *(overrides or []), "--run-dir", str(run.path)], max_restarts,
                    restart_backoff)
    _guarded(lambda: api.execute(cfg, run, resume=False), run)


@app.command()
def resume(run_dir: Path = typer.Argument(..., help="a run directory written by `tide run`"),
           iterations: Optional[int] = typer.Option(None, "--iterations", help="extend (or shorten) the run to N "
                                                    "iterations; the resolved config records the new length"),
           max_restarts: int = MAX_RESTARTS, restart_backoff: float = RESTART_BACKOFF) -> None:
    """Continue a killed or finished run from its newest complete checkpoint.

    With --iterations N a finished run goes on to iteration N, exactly as a run started with N iterations
    would have (learning-rate schedules that decay over the run are stretched to the new length, so with
    those only the iterations up to the checkpoint are shared)."""
    try:
        cfg, run = api.prepare_resume(run_dir, iterations)
    except (ConfigError, api.UsageError, RunDirBusy) as e:
        _fail(str(e), 2)
    if max_restarts:
        _supervised(run, ["resume", str(run_dir), *(["--iterations", str(iterations)] if iterations else [])],
                    max_restarts, restart_backoff)
    _guarded(lambda: api.execute(cfg, run, resume=True), run)


@app.command()
def inspect(run_dir: Path = typer.Argument(..., help="a run directory"),
            plot: bool = typer.Option(True, help="write RUN_DIR/timings.png")) -> None:
    """Per-phase timing table and a plot of phase time and reward per iteration."""
    from orchestrator.run.inspect import inspect_run

    if not (run_dir / "timings.jsonl").is_file():
        _fail(f"{run_dir} has no timings.jsonl", 2)
    inspect_run(RunDir(run_dir), plot=plot)


@app.command()
def export(run_dir: Path = typer.Argument(..., help="a run directory"),
           out: Path = typer.Argument(..., help="the Hugging Face directory to write"),
           iteration: Optional[int] = typer.Option(None, "--iteration", help="a kept checkpoint (default: newest)"),
           verify: bool = typer.Option(False, "--verify", help="load the export with transformers (a LoRA "
                                       "adapter with PEFT, over its base) and check its logits against Megatron's "
                                       "(float32: to 1e-4)"),
           merged: bool = typer.Option(False, "--merged", help="a LoRA run (trainer.lora): the base with the "
                                       "adapter merged in, instead of the adapter alone"),
           ) -> None:
    """Write a kept checkpoint as a Hugging Face model directory (safetensors, config, tokenizer), from any
    trainer layout, in this process: no Ray, no vLLM; a LoRA run's as a PEFT adapter directory over its base
    (--merged: the merged model). A finished run already holds its last iteration in RUN_DIR/hf."""
    from orchestrator.run.export import ExportMismatch, export_checkpoint

    if not (run_dir / "config.yaml").is_file():
        _fail(f"{run_dir} is not a run directory (no config.yaml)", 2)
    try:
        result = export_checkpoint(RunDir(run_dir), out, iteration, verify, merged)
    except (FileNotFoundError, ValueError) as e:
        _fail(f"error: {e}", 2)
    except ExportMismatch as e:
        _fail(f"error: {e}", 1)
    typer.echo(f"wrote {result.path} (iteration {result.iteration})")
    if result.logit_diff is not None:
        typer.echo(f"verified: max |logit difference| transformers vs Megatron {result.logit_diff:.2e}, "
                   f"max |log-prob difference| {result.logprob_diff:.2e}")


@app.command()
def plan(config: Path = typer.Argument(..., help="YAML config"),
         overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
         gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, help="GPUs of a node (device cuda)"),
         gpu_memory_gb: float = typer.Option(80.0, "--gpu-memory-gb", min=0.001, help="memory of one GPU "
                                             "(device cuda)"),
         host_memory_gb: Optional[float] = typer.Option(None, "--host-memory-gb", min=0.001, help="the host's "
                                                        "RAM on cpu; default: this machine's"),
         prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", min=1, help="the longest prompt; "
                                                     "default: rollout.max_prompt_tokens, else the longest of the "
                                                     "task's prompts rendered"),
         shm_gb: Optional[float] = typer.Option(None, "--shm-gb", min=0.001, help="a trainer node's shared memory "
                                                "(/dev/shm); with placement.trainer_nodes > 1, whether each node's "
                                                "share of the published checkpoint fits it"),
         as_json: bool = typer.Option(False, "--json", help="print the plan as JSON")) -> None:
    """Whether the config's trainer ranks and engines fit in memory, and the smallest change that makes them fit:
    per trainer rank weights, gradients, optimizer state, activations at the longest sample (with and without
    recompute), logits and log-prob chunk; per engine weights and KV cache (docs/training.md, "Memory planner");
    with placement.trainer_nodes > 1 each node's ranks and its share of the published checkpoint. Nothing is run.
    Exit 1 when it does not fit."""
    from orchestrator.run.plan import plan as make_plan, render

    cfg = _load(config, overrides)
    if cfg.engine != "megatron":
        _fail("tide plan: the megatron engine's runs only (the JAX engine trains no LLM)", 2)
    result = make_plan(cfg, gpus_per_node, gpu_memory_gb, host_memory_gb, prompt_tokens, shm_gb)
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
    else:
        render(result)
    raise typer.Exit(0 if result.fits else 1)


@config_app.command("show")
def config_show(config: Path = typer.Argument(..., help="YAML config"),
                overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP,
                                                                show_default=False)) -> None:
    """Print the resolved config as YAML: every default filled in, paths absolute, as a run writes it to
    RUN_DIR/config.yaml."""
    typer.echo(dump_config(_load(config, overrides)), nl=False)


@config_app.command("reference")
def config_reference() -> None:
    """Print the reference of every config key as markdown (docs/config.md)."""
    from orchestrator.config.reference import reference_markdown

    typer.echo(reference_markdown(), nl=False)


def _guarded(fn, run: RunDir) -> None:
    """Run `fn`, ending the process with its reason first and the exit code that says whether a restart could
    help (orchestrator/run/failures.py): 2 for the user's input or code, 1 for a fault, 130 when interrupted. The
    traceback goes to RUN_DIR/error.log unless the run's directory was removed (an input error before anything
    ran)."""
    # SIGTERM (a scheduler's preemption, `kill`) unwinds like Ctrl-C, so the run's engines, trainer ranks,
    # sandbox and /dev/shm copies are released by the same `finally` blocks instead of being orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        fn()
    except KeyboardInterrupt:
        _fail("interrupted; `tide resume` continues from the newest checkpoint", 130)
    except Exception as e:
        from orchestrator.run.failures import console_report, exit_code, write_error_log

        log = write_error_log(run.path, e) if run.path.is_dir() else None
        _fail(console_report(e, log), exit_code(e))


def main() -> None:
    try:
        app()
    except SystemExit as e:
        _end(e.code)


def _end(code: object) -> NoReturn:
    """End the process with exit status `code` as Python would (atexit handlers run, standard streams flushed) but
    without the interpreter's own teardown, which frees the whole heap object by object: after a run (torch,
    transformers, Ray and the run's own objects) that took 1.3-1.5 s, ending a 15 s run of the test suite's
    size 0.05 s after its atexit handlers instead (measured). Not while a thread the interpreter would wait for
    runs (a non-daemon one)."""
    waited_for = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if waited_for or not (code is None or isinstance(code, int)):
        raise SystemExit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: what it would have printed has nowhere to go
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    sys.exit(main())
