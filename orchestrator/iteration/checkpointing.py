"""Checkpoints of an LLM run: the trainer ranks' Megatron distributed checkpoint (model, optimizer, RNG) and
the run state, written atomically through `RunDir.writing_checkpoint`.

The run state is the iteration, and with rollout.max_staleness 1 the batch drawn ahead for the next one:
everything else a resumed run needs is a pure function of the config and the iteration (each iteration's
prompts come from (seed, iteration); sampling seeds likewise), and the metrics and timings of later iterations
are dropped from the run directory on resume."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from orchestrator.records.rundir import RunDir
from orchestrator.workers.trainer_group import TrainerGroup


def save_checkpoint(run: RunDir, trainer: TrainerGroup, iteration: int, keep: int,
                    also: Callable[[Path], None] | None = None) -> None:
    """`also(directory)` adds to the checkpoint what the run state needs besides the iteration (the batch a
    max_staleness 1 run drew ahead: orchestrator/iteration/schedule.py)."""
    with run.writing_checkpoint(iteration, {"iteration": iteration}) as tmp:
        trainer.save_checkpoint(str(tmp))
        if also is not None:
            also(Path(tmp))
    run.prune_checkpoints(keep)


def restore_checkpoint(run: RunDir, trainer: TrainerGroup) -> int | None:
    """Load the newest complete checkpoint into the trainer and return its iteration (None: there is none)."""
    ckpt = run.latest_checkpoint()
    if ckpt is None:
        return None
    trainer.load_checkpoint(str(ckpt))
    iteration = run.read_run_state(ckpt)["iteration"]
    run.truncate_after(iteration)
    return iteration
