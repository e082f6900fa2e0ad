"""RolloutEngine.park (rollout.sync_mode restart with the trainer on the same GPUs, the Kimi way): the engine's
process is stopped while the trainer holds the devices, and its next call starts it again on the weights it served,
as a start and not as a death."""
from __future__ import annotations

import ray

from rollout.tasks import AdditionTask


def test_a_parked_engine_holds_no_process_and_its_next_call_starts_it_on_the_same_weights(rollout_engine):
    args = (AdditionTask(1).problems(0, 0, 2), 2, 6, 1.0, 7)
    before = ray.get(rollout_engine.generate.remote(*args), timeout=600)
    running = ray.get(rollout_engine.info.remote())
    ray.get(rollout_engine.park.remote(), timeout=600)
    parked = ray.get(rollout_engine.info.remote())
    assert running["engine_pid"] is not None and parked["engine_pid"] is None
    after = ray.get(rollout_engine.generate.remote(*args), timeout=600)
    again = ray.get(rollout_engine.info.remote())
    assert [s.completion_ids for s in after] == [s.completion_ids for s in before]
    assert again["starts"] == running["starts"] + 1 and again["engine_deaths"] == running["engine_deaths"]
    assert again["checkpoint_dir"] == running["checkpoint_dir"]
