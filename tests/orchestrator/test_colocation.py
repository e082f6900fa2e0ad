"""The hybrid deployment's settings (orchestrator/iteration/colocation.py, rollout.sleep_level): what is refused by
name before anything starts, and what trainer.offload_between_phases resolves to."""
from __future__ import annotations

import pytest

from orchestrator.config.schema import ConfigError, parse_config
from orchestrator.config.placement import check_handover
from orchestrator.iteration.colocation import offloads_between_phases
from rollout.config import EngineConfig, RolloutConfig

BASE = {"name": "t", "iterations": 1, "model": {"tiny": {}}, "task": {"name": "addition"}}


def _cfg(trainer=None, rollout=None, placement=None):
    return parse_config(BASE | {"trainer": trainer or {}, "rollout": rollout or {}, "placement": placement or {}})


def test_offload_between_phases_is_on_exactly_when_set_or_colocated_on_cuda():
    assert not offloads_between_phases(_cfg())  # CPU: colocated cores, nothing to hand over
    assert offloads_between_phases(_cfg(trainer={"offload_between_phases": True}))
    assert not offloads_between_phases(_cfg(trainer={"device": "cuda", "backend": "nccl"},
                                            rollout={"device": "cuda"}, placement={"mode": "disaggregated"}))


def test_sleep_level_is_refused_on_cpu_and_with_restarts_naming_the_field():
    with pytest.raises(ValueError, match="rollout.sleep_level 1.*cpu"):
        EngineConfig(sleep_level=1)
    with pytest.raises(ValueError, match="rollout.sleep_level 2.*sync_mode reload"):
        RolloutConfig(device="cuda", sleep_level=2, sync_mode="restart")
    RolloutConfig(device="cuda", sleep_level=2)


def test_a_handover_with_overlapping_phases_or_nothing_to_make_room_for_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="trainer.offload_between_phases.*max_staleness 1"):
        _cfg(trainer={"offload_between_phases": True}, rollout={"max_staleness": 1, "mismatch_correction": "tis"})
    with pytest.raises(ConfigError, match="rollout.sleep_level 1.*offload_between_phases"):
        _cfg(trainer={"device": "cuda", "backend": "nccl"}, rollout={"device": "cuda", "sleep_level": 1},
             placement={"mode": "disaggregated"})
    accepted = _cfg(trainer={"offload_between_phases": True})
    check_handover(accepted.placement, accepted.trainer, accepted.rollout)


class _Recorder:
    """A session's trainer, engines and run directory, recording what the handover asks of them in order."""

    def __init__(self, cfg):
        self.cfg, self.calls, self.trainer, self.rollout, self.run = cfg, [], self, self, self

    def offload(self):
        self.calls.append("trainer.offload")
        return {"offload_bytes": 10, "released_bytes": 14, "offload_s": 0.1}

    def onload(self):
        self.calls.append("trainer.onload")
        return {"onload_bytes": 10, "onload_s": 0.1}

    def sleep(self, level):
        self.calls.append(f"engines.sleep({level})")

    def wake_up(self):
        self.calls.append("engines.wake_up")

    def park(self):
        self.calls.append("engines.park")

    def phase(self, iteration, name):
        from contextlib import contextmanager

        @contextmanager
        def timed():
            rec = {}
            yield rec
            self.calls.append((iteration, name, rec["bytes"], sorted(rec["parts"])))

        return timed()


def test_the_engines_sleep_before_the_trainer_takes_its_memory_back_and_wake_after_it_gave_it():
    from orchestrator.iteration.colocation import Handover

    s = _Recorder(_cfg(trainer={"device": "cuda", "backend": "nccl", "offload_between_phases": True},
                       rollout={"device": "cuda", "sleep_level": 2}, placement={"mode": "disaggregated"}))
    devices = Handover(s)
    devices.to_trainer(1)  # the trainer holds its memory at the start: nothing to do
    devices.to_engines(1)
    devices.to_engines(1)  # twice: once
    with devices.trainer_turn(1):
        s.calls.append("checkpoint")
    with devices.beside_engines(1, needed=False):
        s.calls.append("no probe")
    with devices.beside_engines(1, needed=True):
        s.calls.append("probe")
    assert s.calls == [
        "trainer.offload", "engines.wake_up", (1, "offload", 10, ["engine_wake", "trainer"]),
        "engines.sleep(2)", "trainer.onload", (1, "onload", 10, ["engine_sleep", "trainer"]),
        "checkpoint",
        "trainer.offload", "engines.wake_up", (1, "offload", 10, ["engine_wake", "trainer"]),
        "no probe",
        "trainer.onload", (1, "onload", 10, ["trainer"]), "probe", "trainer.offload", (1, "offload", 10, ["trainer"]),
    ]


def test_with_restarts_the_engines_are_stopped_before_the_trainer_takes_its_memory_back():
    """sync_mode restart (the Kimi way): nothing to wake; the sync (or the next call) starts them."""
    from orchestrator.iteration.colocation import Handover

    s = _Recorder(_cfg(trainer={"device": "cuda", "backend": "nccl", "offload_between_phases": True},
                       rollout={"device": "cuda", "sync_mode": "restart"}, placement={"mode": "disaggregated"}))
    devices = Handover(s)
    devices.to_engines(1)
    devices.to_trainer(1)
    assert s.calls == ["trainer.offload", (1, "offload", 10, ["trainer"]),
                       "engines.park", "trainer.onload", (1, "onload", 10, ["engine_stop", "trainer"])]


def test_before_engines_on_the_trainers_gpus_start_the_trainer_offloads_with_no_engine_to_wake():
    """Colocated on GPUs the engines start after the trainer's start-up offload (the session has none yet): only
    the trainer moves; the next to_engines finds the devices handed over already."""
    from orchestrator.iteration.colocation import Handover

    s = _Recorder(_cfg(trainer={"device": "cuda", "backend": "nccl", "offload_between_phases": True},
                       rollout={"device": "cuda", "sleep_level": 1}, placement={"mode": "disaggregated"}))
    s.rollout = None
    devices = Handover(s)
    devices.to_engines(0)
    devices.to_engines(1)
    assert s.calls == ["trainer.offload", (0, "offload", 10, ["trainer"])]
