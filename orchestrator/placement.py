"""Where the trainer ranks, the rollout engines and the weight hand-over's node agents run on a Ray cluster.

On GPUs two placement groups are reserved before anything starts: the trainer's ranks, one GPU each, all on one
node (STRICT_PACK: the ranks publish into that node's shared memory, which its node agent serves), then one
bundle of `rollout.tp` GPUs per engine (PACK: as few nodes as fit). Engine k and rollout node agent k (which
pulls each iteration into that node's shared memory, where engine k loads it) are both scheduled into bundle
k, so they share a node; the source agent runs on the trainer's node. On CPU (one machine, the embedded
default) nothing is pinned and nothing is reserved."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_transfer import AgentPlacement
from rollout.config import RolloutConfig
from trainer.config import TrainerConfig

PLACEMENT_TIMEOUT_S = 600


@dataclass
class Placement:
    trainer: Any = None  # Ray placement groups, or None: no pinning
    engines: Any = None

    @classmethod
    def reserve(cls, trainer: TrainerConfig, rollout: RolloutConfig) -> "Placement":
        """Reserve (and wait for) the GPUs of the trainer ranks and of the engines; raise naming what does not
        fit, with the free GPUs per node."""
        placement = cls()
        try:
            if trainer.device == "cuda":
                placement.trainer = _reserve([{"GPU": 1}] * trainer.parallel.world, "STRICT_PACK",
                                             f"{trainer.parallel.world} trainer ranks (trainer.parallel: dp x tp x "
                                             f"pp x ep) on one node")
            if rollout.device == "cuda":
                placement.engines = _reserve([{"GPU": rollout.tp}] * rollout.engines, "PACK",
                                             f"{rollout.engines} rollout engine(s) of {rollout.tp} GPU(s) each "
                                             f"(rollout.engines x rollout.tp)")
        except BaseException:
            placement.release()
            raise
        return placement

    def trainer_rank(self, i: int) -> dict:
        """Ray actor options that put trainer rank i into its bundle."""
        return _in_bundle(self.trainer, i)

    def engine(self, k: int) -> dict:
        """Ray actor options that put an actor into engine k's bundle."""
        return _in_bundle(self.engines, k)

    def agents(self, engines: int, trainer_node_id: str) -> AgentPlacement:
        """The node agents: the source beside the trainer's ranks, agent k in engine k's bundle."""
        if self.engines is None:
            return AgentPlacement()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        beside_trainer = NodeAffinitySchedulingStrategy(trainer_node_id, soft=False)
        return AgentPlacement(source={"scheduling_strategy": beside_trainer},
                              sinks=[self.engine(k) for k in range(engines)])

    def release(self) -> None:
        import ray

        for group in (self.trainer, self.engines):
            if group is not None:
                ray.util.remove_placement_group(group)
        self.trainer = self.engines = None


def _reserve(bundles: list[dict], strategy: str, what: str):
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy)
    if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
        ray.util.remove_placement_group(group)
        free = {node: res.get("GPU", 0.0) for node, res in ray._private.state.available_resources_per_node().items()}
        raise RuntimeError(f"the Ray cluster has no room for {what} after {PLACEMENT_TIMEOUT_S} s; free GPUs per "
                           f"node: {free}")
    return group


def _in_bundle(group: Any, index: int) -> dict:
    if group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}
