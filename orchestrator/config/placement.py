"""The YAML `placement:` section and the checks that tie it to the trainer's and the engines' sections: where
trainer ranks and engines run (orchestrator/workers/placement.py reserves it)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ckpt_transfer.config import StrictModel
from rollout.config import RolloutConfig
from trainer.config import TrainerConfig


class PlacementConfig(StrictModel):
    mode: Literal["colocated", "disaggregated"] | None = Field(
        None, description="`colocated`: the engines and the trainer ranks take turns on the same CPU cores (each "
        "phase gets them all), the same GPUs on cuda (the hybrid deployment: engine k on the GPUs of trainer ranks "
        "k x rollout.tp onwards, the ranks moving their memory to the host between phases: "
        "trainer.offload_between_phases, rollout.sleep_level); `disaggregated`: they get disjoint cores on CPU "
        "(placement.rollout_cpus for the engines and the run's own sandbox service, the rest for the ranks), disjoint "
        "GPUs on cuda, so that a rollout overlapping training (rollout.max_staleness 1) runs beside it instead of on "
        "its cores. null: colocated on CPU, disaggregated where trainer or engines use GPUs.")
    rollout_cpus: int | None = Field(None, ge=1, description="Disaggregated on CPU: how many of the host's cores "
                                     "the engines get (the first ones; the trainer ranks get the others); null: "
                                     "half of them.")
    trainer_nodes: int = Field(1, ge=1, description="The nodes the trainer's ranks span: world / trainer_nodes "
                               "consecutive ranks on each (Megatron's rank order runs tp, ep, dp, pp from fastest "
                               "to slowest, so with pp = trainer_nodes each node holds a pipeline stage, with pp 1 "
                               "and dp = trainer_nodes a data-parallel replica). Each node's ranks publish the "
                               "Hugging Face tensors they own into that node's shared memory (data-parallel "
                               "replicas split the writing), and the engines' nodes pull every tensor from a node "
                               "that holds it (transfer.enabled): no node gathers the whole checkpoint. 1: every "
                               "rank on one node.")

    @model_validator(mode="after")
    def _cpus_only_when_disaggregated(self) -> "PlacementConfig":
        if self.rollout_cpus is not None and self.mode != "disaggregated":
            raise ValueError("placement.rollout_cpus splits the cores of placement.mode disaggregated: set the mode "
                             "or remove rollout_cpus")
        return self


def offloads_between_phases(placement: PlacementConfig, trainer: TrainerConfig) -> bool:
    """trainer.offload_between_phases resolved: null is on exactly when colocated on CUDA."""
    if trainer.offload_between_phases is not None:
        return trainer.offload_between_phases
    return placement.mode == "colocated" and trainer.device == "cuda"


def check_handover(placement: PlacementConfig, trainer: TrainerConfig, r: RolloutConfig) -> None:
    """Refuses what cannot take turns (orchestrator/iteration/colocation.py): the engines draw a batch ahead while
    the trainer trains (max_staleness), or they sleep while the trainer keeps its memory (nothing to make room
    for)."""
    offloads = offloads_between_phases(placement, trainer)
    if offloads and r.max_staleness:
        raise ValueError(f"trainer.offload_between_phases: trainer and engines take turns on the same devices, but "
                         f"rollout.max_staleness {r.max_staleness} has the engines draw the next batch while the "
                         f"trainer trains: use max_staleness 0")
    if r.sleep_level and not offloads:
        raise ValueError(f"rollout.sleep_level {r.sleep_level}: the engines sleep while the trainer holds the GPUs, "
                         f"which it does between phases only with trainer.offload_between_phases (null: on with "
                         f"placement.mode colocated and trainer.device cuda)")


def check_placement(placement: PlacementConfig, trainer: TrainerConfig, r: RolloutConfig,
                    transfer_enabled: bool) -> None:
    """ValueError naming the fields of a layout placement cannot make (TideConfig's validation)."""
    check_handover(placement, trainer, r)
    gpus = "cuda" in (trainer.device, r.device)
    nodes, world = placement.trainer_nodes, trainer.parallel.world
    if nodes > 1 and world % nodes:
        raise ValueError(f"placement.trainer_nodes {nodes}: the trainer's {world} ranks (trainer.parallel: "
                         f"dp x tp x pp x ep) do not split evenly over {nodes} nodes")
    if nodes > 1 and not transfer_enabled:
        raise ValueError(f"placement.trainer_nodes {nodes}: each node publishes what its ranks own into its "
                         f"own shared memory, and the engines' nodes pull it through the transfer engine: "
                         f"set transfer.enabled true")
    if gpus and placement.mode == "colocated":
        if trainer.device != r.device:
            raise ValueError(f"placement.mode colocated: the engines share the trainer ranks' devices, but "
                             f"trainer.device is {trainer.device} and rollout.device {r.device}")
        if r.engines * r.tp > world:
            raise ValueError(f"placement.mode colocated: {r.engines} engine(s) of rollout.tp {r.tp} need "
                             f"{r.engines * r.tp} GPUs, the trainer's ranks hold {world}: fewer engines, or "
                             f"placement.mode disaggregated")
        if nodes > 1 and (world // nodes) % r.tp:
            raise ValueError(f"placement.mode colocated: an engine's rollout.tp {r.tp} GPUs must lie on one "
                             f"node, which holds {world // nodes} trainer ranks (placement.trainer_nodes "
                             f"{nodes})")
    if not gpus and placement.mode == "disaggregated" and "VLLM_CPU_OMP_THREADS_BIND" in r.extra_env:
        raise ValueError("rollout.extra_env.VLLM_CPU_OMP_THREADS_BIND and placement.mode disaggregated both "
                         "choose the engines' cores: remove one")
    if gpus and placement.rollout_cpus is not None:
        raise ValueError("placement.rollout_cpus splits CPU cores; with GPUs engines and ranks get their own "
                         "GPUs: remove it")
