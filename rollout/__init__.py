"""Rollout: the vLLM engine (`rollout.engine`, imported on demand: it imports vLLM), its settings and the
`rollout:` / `task:` sections (`rollout.config`), tasks and verifiers, and the Samples batch that flows to
reward and training."""
from .config import EngineConfig, RolloutConfig, TaskConfig
from .samples import Sample, Samples
from .tasks import Problem, Task, make_task

__all__ = ["EngineConfig", "RolloutConfig", "TaskConfig", "Sample", "Samples", "Problem", "Task", "make_task"]
