"""The top floor: a run's config, its components, the RL iteration and the CLI, each a sub-package, from the
bottom up (a package imports only those above it in this list):

- `records`: the run directory (metrics, timings, samples, checkpoints' layout, status, lock) and its loggers;
- `rewards`: reward functions (the user's and the built-in ones) and the reward phase;
- `config`: the YAML schema, its names, reference and hints;
- `workers`: what a run starts: the Ray cluster, placement, the trainer and engine groups, the sandbox service,
  the task's prompts rendered by the chat template;
- `agents`: multi-turn trajectories and partial rollouts, as the loop draws them;
- `iteration`: the session (the components of one run) and the RL iteration: the loop, its schedule, batches,
  checks, evaluation, checkpoints (and the JAX engine's loop);
- `run`: the CLI, the supervisor that restarts a run, `tide inspect` and export.
"""
from orchestrator.config import ConfigError, TideConfig, load_config, parse_config
from orchestrator.records import RunDir

__all__ = ["ConfigError", "TideConfig", "load_config", "parse_config", "RunDir"]
