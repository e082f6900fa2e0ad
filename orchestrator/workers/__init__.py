"""What a run starts and drives: the Ray cluster (cluster.py), where each component runs (placement.py), the
trainer ranks (trainer_group.py), the vLLM engines (rollout_group.py), the sandbox service, the second models served
for rewards (served_models.py), and the task's prompts rendered by the chat template (prompts.py)."""
from orchestrator.workers.cluster import Cluster, connect
from orchestrator.workers.placement import Placement
from orchestrator.workers.prompts import RenderedTask
from orchestrator.workers.rollout_group import RolloutGroup
from orchestrator.workers.sandbox_service import SandboxService
from orchestrator.workers.served_models import ServedModels
from orchestrator.workers.trainer_group import TrainerGroup

__all__ = ["Cluster", "Placement", "RenderedTask", "RolloutGroup", "SandboxService", "ServedModels", "TrainerGroup",
           "connect"]
