"""Rollout: the vLLM engine (`rollout.engine`, imported on demand: it imports vLLM), tasks and verifiers, and
the Samples batch that flows to reward and training."""
from .samples import Sample, Samples
from .tasks import Problem, Task, make_task

__all__ = ["Sample", "Samples", "Problem", "Task", "make_task"]
