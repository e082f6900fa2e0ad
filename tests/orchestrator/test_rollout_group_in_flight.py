"""RolloutGroup.generate with weights taken in flight, on two stand-in engine actors: only an engine given prompts
is readied for the in-flight sync (an engine readied for a generate that never comes would hold the sync until
its timeout), and the readying happens before any generate call."""
from __future__ import annotations

import threading

import ray

from orchestrator.workers.rollout_group import RolloutGroup
from rollout.config import EngineConfig
from rollout.in_flight import InFlight
from rollout.samples import Sample, Samples
from rollout.tasks import AdditionTask


@ray.remote(num_cpus=0)
class StandIn:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def open_in_flight(self, switch: InFlight) -> None:
        self.calls.append(f"open {switch.to_version}")

    def generate(self, problems, n_samples, *rest) -> Samples:
        self.calls.append(f"generate {len(problems)} in_flight={rest[-1] is not None}")
        return Samples([Sample(0, p.task_id, [1], [2], [-0.5]) for p in problems for _ in range(n_samples)])

    def log(self) -> list[str]:
        return self.calls


def _group(engines: list) -> RolloutGroup:
    """A group over given actors (RolloutGroup's constructor would start vLLM engines)."""
    group = RolloutGroup.__new__(RolloutGroup)
    group.cfg, group.timeout, group.stop, group.stop_token_ids = EngineConfig(), 60.0, (), ()
    group.engines, group._replacing = engines, threading.Lock()
    return group


def test_only_engines_given_prompts_are_readied_for_weights_in_flight(ray_cluster):
    engines = [StandIn.remote(), StandIn.remote()]
    group, opened = _group(engines), threading.Event()
    out = group.generate(AdditionTask(1).problems(0, 0, 1), 2, 4, _Sampling(), 0, InFlight(0, 1, 2), opened)
    assert len(out) == 2 and opened.is_set()
    assert [ray.get(e.log.remote()) for e in engines] == [[], ["open 1", "generate 1 in_flight=True"]]
    out = group.generate(AdditionTask(1).problems(0, 0, 2), 1, 4, _Sampling(), 0)  # not in flight: no readying
    assert [ray.get(e.log.remote())[-1] for e in engines] == ["generate 1 in_flight=False"] * 2
    for e in engines:
        ray.kill(e)


class _Sampling:
    temperature, top_p, top_k = 1.0, 1.0, 0
