"""The hybrid deployment's handover (placement.mode colocated on CUDA, veRL's hybrid engine, slime's colocate mode):
trainer ranks and engines take turns on the same GPUs. After each publish the trainer's ranks move their
parameters, optimizer state and gradients to host memory (trainer/megatron/offload.py) and, with
rollout.sleep_level, the engines wake for the sync and the next rollout; before the trainer's next pass the engines
sleep and the ranks take their memory back, bit for bit. With sync_mode restart (the Kimi way) the engines are
stopped instead, and the sync starts them on the new weights. Each move is a phase of timings.jsonl (`offload`,
`onload`, with the engines' part as `engine_wake`, `engine_sleep` or `engine_stop`). trainer.offload_between_phases
turns it on off GPUs too (the CPU run of the suite); off, every call here does nothing."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from orchestrator.config.placement import offloads_between_phases as placement_offloads

if TYPE_CHECKING:
    from orchestrator.config.schema import TideConfig


def offloads_between_phases(cfg: TideConfig) -> bool:
    """trainer.offload_between_phases resolved: null is on exactly when colocated on CUDA."""
    return placement_offloads(cfg.placement, cfg.trainer)


class Handover:
    """Who holds the devices: the engines (rollout, sync, eval) or the trainer (log-probs, train step, publish,
    checkpoint). A run starts with the trainer holding them (it warms up or restores)."""

    def __init__(self, s: Any) -> None:
        """`s`: the run's Session (orchestrator/iteration/session.py, which builds this), read for its config, run
        directory, trainer and engines."""
        self.s, self.on = s, offloads_between_phases(s.cfg)
        self.sleep_level = s.cfg.rollout.sleep_level
        self.stops_engines = s.cfg.rollout.sync_mode == "restart"  # each sync starts them anew anyway
        self.engines_hold = False

    def to_engines(self, iteration: int) -> None:
        """The trainer's memory out, the engines awake: after the publish, and before the run's first rollout (or, for
        engines placed on the trainer ranks' GPUs, before they start: vLLM sizes itself on the free memory it finds;
        none is there to wake yet). Stopped engines start at their next call (the sync, or a rollout after a
        checkpoint's turn)."""
        if not self.on or self.engines_hold:
            return
        with self.s.run.phase(iteration, "offload") as rec:
            out = self.s.trainer.offload()
            parts = {"trainer": out["offload_s"]}
            if self.sleep_level and self.s.rollout is not None:
                start = time.perf_counter()
                self.s.rollout.wake_up()
                parts["engine_wake"] = time.perf_counter() - start
            rec["bytes"], rec["parts"] = out["offload_bytes"], parts
        self.engines_hold = True

    def to_trainer(self, iteration: int) -> None:
        """The engines asleep (or stopped), the trainer's memory back: before its first pass of an iteration."""
        if not self.on or not self.engines_hold:
            return
        with self.s.run.phase(iteration, "onload") as rec:
            parts = {}
            if self.sleep_level:
                start = time.perf_counter()
                self.s.rollout.sleep(self.sleep_level)
                parts["engine_sleep"] = time.perf_counter() - start
            elif self.stops_engines:
                start = time.perf_counter()
                self.s.rollout.park()
                parts["engine_stop"] = time.perf_counter() - start
            out = self.s.trainer.onload()
            rec["bytes"], rec["parts"] = out["onload_bytes"], parts | {"trainer": out["onload_s"]}
        self.engines_hold = False

    @contextmanager
    def trainer_turn(self, iteration: int) -> Iterator[None]:
        """A pass of the trainer between the engines' turns (a checkpoint): the devices handed to it and back."""
        held = self.engines_hold
        self.to_trainer(iteration)
        yield
        if held:
            self.to_engines(iteration)

    @contextmanager
    def beside_engines(self, iteration: int, needed: bool) -> Iterator[None]:
        """A pass that needs the awake engines and the trainer at once (the probe, when `needed`): the trainer's
        memory back beside the engines' for it, and out again after."""
        if not (needed and self.on and self.engines_hold):
            yield
            return
        with self.s.run.phase(iteration, "onload") as rec:
            out = self.s.trainer.onload()
            rec["bytes"], rec["parts"] = out["onload_bytes"], {"trainer": out["onload_s"]}
        yield
        with self.s.run.phase(iteration, "offload") as rec:
            out = self.s.trainer.offload()
            rec["bytes"], rec["parts"] = out["offload_bytes"], {"trainer": out["offload_s"]}
