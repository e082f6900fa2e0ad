"""Worker processes kept between runs that one Python process drives one after another (orchestrator/run/api.py: a
sweep, a benchmark's repeats, the test suite), as Ray Tune reuses its trial actors (`reuse_actors`).

A run on CPU spends most of its start importing: each trainer rank torch and Megatron (~6.5 CPU-s here), each
rollout engine vLLM (~8.5 CPU-s). Given `WorkerPools`, a run borrows started processes and hands them back when it
ends, with the Megatron state or the vLLM engine they held torn down (RankPool, EnginePool). Only workers that run
anywhere on the driver's node are pooled (CPU, no placement group): a GPU rank or engine, or a rank placed on
another node (placement.trainer_nodes), starts as usual."""
from __future__ import annotations

from dataclasses import dataclass, field

import ray

from orchestrator.workers.trainer_group import RankPool


class EnginePool:
    """Started rollout-engine processes (rollout.reusable_engine.ReusableEngine actors) kept between RolloutGroups
    on CPU; a group borrows them (`take`), starts its engines in them and hands them back stopped (`give_back`)."""

    def __init__(self) -> None:
        from rollout.reusable_engine import ReusableEngine

        # as RolloutGroup's own: a generate, a sync handing it weights in flight, and info / engine_pid beside them
        self._actor = ray.remote(num_cpus=0, max_concurrency=3)(ReusableEngine)
        self._idle: list = []

    def take(self):
        return self._idle.pop() if self._idle else self._actor.remote()

    def give_back(self, engine) -> None:
        self._idle.append(engine)

    def close(self) -> None:
        for engine in self._idle:
            ray.kill(engine)
        self._idle = []


@dataclass
class WorkerPools:
    """The pools a run draws on (orchestrator.iteration.session.Session.open `pools`); close() ends their processes."""

    ranks: RankPool = field(default_factory=RankPool)
    engines: EnginePool = field(default_factory=EnginePool)

    def close(self) -> None:
        self.ranks.close()
        self.engines.close()
