"""Where the trainer ranks, the rollout engines and the weight hand-over's node agents run on a Ray cluster.

On GPUs two placement groups are reserved before anything starts: the trainer's ranks, one GPU each, all on one
node (STRICT_PACK: the ranks publish into that node's shared memory, which its node agent serves), then one
bundle of `rollout.tp` GPUs per engine (PACK: as few nodes as fit). Engine k and rollout node agent k (which
pulls each iteration into that node's shared memory, where engine k loads it) are both scheduled into bundle
k, so they share a node; a source agent runs on each trainer node. Colocated on GPUs (the hybrid deployment) the
engines get no GPUs of their own: engine k runs in rank k x rollout.tp's bundle and its vLLM sees the GPUs of
ranks k x tp .. (k + 1) x tp - 1 (CUDA_VISIBLE_DEVICES; Ray gives the engine's actor none), which the trainer's
ranks hand over between phases (orchestrator/iteration/colocation.py). A trainer spanning nodes
(placement.trainer_nodes N) gets one bundle per node (STRICT_SPREAD: N distinct nodes) holding world / N
consecutive ranks, on CPU too (a bundle of one CPU marks the node; the ranks ask for none). On CPU (one machine, the embedded default) nothing is reserved: colocated, the
phases take turns on all the host's cores; disaggregated, the engines' compute threads are bound to the first
placement.rollout_cpus cores (vLLM's VLLM_CPU_OMP_THREADS_BIND; the run's own sandbox service with them, bound by
the session) and the trainer ranks' processes to the others (`pin_threads`), so a rollout drawn ahead
(rollout.max_staleness 1) runs beside the train step, not on its cores."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from ckpt_transfer import AgentPlacement
from rollout.config import RolloutConfig
from trainer.config import TrainerConfig

PLACEMENT_TIMEOUT_S = 600


Mode = Literal["colocated", "disaggregated"]


@dataclass
class Placement:
    trainer: Any = None  # Ray placement groups, or None: no pinning
    engines: Any = None
    trainer_cpus: tuple[int, ...] | None = None  # disaggregated on CPU: the cores of the ranks, and of the engines
    engine_cpus: tuple[int, ...] | None = None
    tp: int = 1  # each engine's TP workers: one OpenMP core group each
    ranks_per_node: int | None = None  # a trainer spanning nodes: consecutive ranks per bundle
    shares_gpus: bool = False  # colocated on GPUs: engines on the trainer ranks' GPUs
    rank_gpus: list[str] | None = None  # colocated on GPUs: each rank's GPU id on its node (`colocate`)

    @classmethod
    def reserve(cls, trainer: TrainerConfig, rollout: RolloutConfig, mode: Mode | None = None,
                rollout_cpus: int | None = None, trainer_nodes: int = 1) -> "Placement":
        """Reserve (and wait for) the GPUs of the trainer ranks and of the engines; raise naming what does not
        fit, with the free GPUs per node. Disaggregated on CPU: split this process's cores (`split_cpus`).
        `trainer_nodes` > 1: the ranks spread over that many nodes (`spread_trainer`)."""
        placement, mode = cls(tp=rollout.tp), resolved_mode(mode, trainer, rollout)
        if mode == "disaggregated" and "cuda" not in (trainer.device, rollout.device):
            if trainer_nodes > 1:
                raise ValueError("placement.mode disaggregated on CPU splits one host's cores between engines and "
                                 "trainer ranks; a trainer spanning nodes (placement.trainer_nodes) has nodes of "
                                 "its own: use placement.mode colocated")
            placement.engine_cpus, placement.trainer_cpus = split_cpus(
                sorted(os.sched_getaffinity(0)), rollout_cpus, rollout)
        try:
            placement.shares_gpus = mode == "colocated" and rollout.device == "cuda"
            if trainer_nodes > 1:
                placement.trainer, placement.ranks_per_node = spread_trainer(trainer, trainer_nodes)
            elif trainer.device == "cuda":
                placement.trainer = _reserve([{"GPU": 1}] * trainer.parallel.world, "STRICT_PACK",
                                             f"{trainer.parallel.world} trainer ranks (trainer.parallel: dp x tp x "
                                             f"pp x ep) on one node")
            if rollout.device == "cuda" and not placement.shares_gpus:
                placement.engines = _reserve([{"GPU": rollout.tp}] * rollout.engines, "PACK",
                                             f"{rollout.engines} rollout engine(s) of {rollout.tp} GPU(s) each "
                                             f"(rollout.engines x rollout.tp)")
        except BaseException:
            placement.release()
            raise
        return placement

    def engine_env(self, extra_env: dict[str, str]) -> dict[str, str]:
        """The engines' environment (rollout.extra_env) with their OpenMP threads bound to their cores."""
        if self.engine_cpus is None:
            return extra_env
        return {**extra_env, "VLLM_CPU_OMP_THREADS_BIND": _omp_bind(self.engine_cpus, self.tp)}

    def trainer_rank(self, i: int) -> dict:
        """Ray actor options that put trainer rank i into its bundle (its node's, for a trainer spanning nodes)."""
        return _in_bundle(self.trainer, i if self.ranks_per_node is None else i // self.ranks_per_node)

    def engine(self, k: int) -> dict:
        """Ray actor options that put an actor into engine k's bundle; colocated on GPUs, into the bundle of the
        first trainer rank whose GPUs it shares, asking Ray for none and shown those (`colocate` first)."""
        if not self.shares_gpus:
            return _in_bundle(self.engines, k)
        if self.rank_gpus is None:
            raise RuntimeError("colocated on GPUs the engines are placed on the trainer ranks' GPUs: call "
                               "Placement.colocate with them once the trainer has started")
        first = k * self.tp
        visible = ",".join(self.rank_gpus[first:first + self.tp])
        return {**self.trainer_rank(first), "num_gpus": 0,
                "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": visible}}}

    def colocate(self, rank_nodes: list[str], rank_gpus: list[list[str]], engines: int) -> None:
        """Colocated on GPUs: record each trainer rank's GPU (its node, in rank order, and its one GPU id there) for
        the engines to share: engine k the GPUs of ranks k x tp .. (k + 1) x tp - 1, which must be one node's."""
        if not self.shares_gpus:
            return
        need = engines * self.tp
        if need > len(rank_gpus):
            raise ValueError(f"placement.mode colocated: {engines} engine(s) of rollout.tp {self.tp} need {need} "
                             f"GPUs, the trainer's ranks hold {len(rank_gpus)}")
        for k in range(engines):
            ranks = range(k * self.tp, (k + 1) * self.tp)
            if len({rank_nodes[i] for i in ranks}) > 1:
                raise ValueError(f"placement.mode colocated: engine {k}'s GPUs (those of trainer ranks "
                                 f"{ranks.start}-{ranks.stop - 1}) lie on several nodes; rollout.tp must divide the "
                                 f"ranks per node")
        self.rank_gpus = [gpus[0] for gpus in rank_gpus]

    def agents(self, engines: int, trainer_node_ids: list[str]) -> AgentPlacement:
        """The node agents: a source on each of the trainer's nodes (Ray node ids, in the trainer's node order),
        agent k in engine k's bundle (anywhere without one)."""
        placed_engines = self.engines is not None or self.shares_gpus
        if not placed_engines and len(trainer_node_ids) == 1:
            return AgentPlacement()  # one machine: wherever Ray puts them
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        sources = [{"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
                   for node_id in trainer_node_ids]
        sinks = [self.trainer_rank(k * self.tp) if self.shares_gpus else self.engine(k) for k in range(engines)]
        return AgentPlacement(sources=sources, sinks=sinks if placed_engines else [])

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
        kind = "GPU" if any("GPU" in b for b in bundles) else "CPU"
        free = {node: res.get(kind, 0.0) for node, res in ray._private.state.available_resources_per_node().items()}
        raise RuntimeError(f"the Ray cluster has no room for {what} after {PLACEMENT_TIMEOUT_S} s; free {kind}s per "
                           f"node: {free}")
    return group


def spread_trainer(trainer: TrainerConfig, nodes: int) -> tuple[Any, int]:
    """The placement group of a trainer spanning `nodes` nodes: one bundle per node (STRICT_SPREAD), of the GPUs
    of its world / nodes ranks on cuda, of one CPU on cpu (the ranks ask for none: the bundle pins the node).
    Returns it and the ranks per node."""
    world = trainer.parallel.world
    if world % nodes:
        raise ValueError(f"placement.trainer_nodes {nodes}: the trainer's {world} ranks do not split evenly over "
                         f"{nodes} nodes")
    per_node = world // nodes
    bundle = {"GPU": per_node} if trainer.device == "cuda" else {"CPU": 1}
    unit = f"{per_node} GPU(s)" if trainer.device == "cuda" else "a CPU"
    return _reserve([bundle] * nodes, "STRICT_SPREAD",
                    f"{world} trainer ranks over {nodes} nodes (placement.trainer_nodes), {per_node} per node: "
                    f"{nodes} distinct nodes with {unit} free each"), per_node


def _in_bundle(group: Any, index: int) -> dict:
    if group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


def resolved_mode(mode: Mode | None, trainer: TrainerConfig, rollout: RolloutConfig) -> Mode:
    """placement.mode, null resolved: colocated on CPU, disaggregated where GPUs are used."""
    return mode or ("disaggregated" if "cuda" in (trainer.device, rollout.device) else "colocated")


def split_cpus(cpus: list[int], rollout_cpus: int | None,
               rollout: RolloutConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the engines' cores, the trainer ranks' cores): the first `rollout_cpus` (null: half) and the others."""
    n = len(cpus)
    k = n // 2 if rollout_cpus is None else rollout_cpus
    if n < 2 or not 1 <= k < n:
        raise ValueError(f"placement.mode disaggregated splits this host's {n} usable core(s) between the engines "
                         f"and the trainer ranks: placement.rollout_cpus must be 1 to {n - 1}, not {k}"
                         if n >= 2 else f"placement.mode disaggregated needs 2 cores or more; this host has {n}")
    if k < rollout.tp:
        raise ValueError(f"placement.rollout_cpus {k}: each engine's rollout.tp {rollout.tp} workers need a core "
                         f"each")
    return tuple(cpus[:k]), tuple(cpus[k:])


def _omp_bind(cpus: tuple[int, ...], tp: int) -> str:
    """A VLLM_CPU_OMP_THREADS_BIND value giving each of `tp` workers an equal share of `cpus` ('0|1')."""
    per = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(tp))
