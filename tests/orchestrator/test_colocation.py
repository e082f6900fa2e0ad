"""The hybrid deployment's settings (orchestrator/iteration/colocation.py, rollout.sleep_level): what is refused by
name before anything starts, and what trainer.offload_between_phases resolves to."""
from __future__ import annotations

import pytest

from orchestrator.config.schema import ConfigError, parse_config
from orchestrator.iteration.colocation import check_handover, offloads_between_phases
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


def test_a_handover_with_overlapping_phases_or_nothing_to_make_room_for_is_refused():
    with pytest.raises(ConfigError, match="trainer.offload_between_phases.*max_staleness 1"):
        check_handover(_cfg(trainer={"offload_between_phases": True},
                            rollout={"max_staleness": 1, "mismatch_correction": "tis"}))
    with pytest.raises(ConfigError, match="rollout.sleep_level 1.*offload_between_phases"):
        check_handover(_cfg(trainer={"device": "cuda", "backend": "nccl"},
                            rollout={"device": "cuda", "sleep_level": 1}, placement={"mode": "disaggregated"}))
    check_handover(_cfg(trainer={"offload_between_phases": True}))
