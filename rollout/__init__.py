"""Rollout: the vLLM engine (`rollout.engine`, imported on demand: it imports vLLM), its settings and the
`rollout:` / `task:` sections (`rollout.config`), tasks and verifiers, the Samples batch that flows to
reward and training, and how users' functions named in a config (tools, reward functions) are found
(`rollout.user_functions`)."""
from .config import EngineConfig, RolloutConfig, TaskConfig
from .samples import Sample, Samples
from .tasks import Problem, Task, make_task
from .user_functions import UserFunctionError, load_function, resolve_in_config, resolve_spec

__all__ = ["EngineConfig", "RolloutConfig", "TaskConfig", "Sample", "Samples", "Problem", "Task", "make_task",
           "UserFunctionError", "load_function", "resolve_in_config", "resolve_spec"]
