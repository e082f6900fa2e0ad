"""The top floor: YAML schema, CLI, Ray placement, the RL loop, run directory and resume."""
from .config import ConfigError, TideConfig, load_config, parse_config
from .rundir import RunDir

__all__ = ["ConfigError", "TideConfig", "load_config", "parse_config", "RunDir"]
