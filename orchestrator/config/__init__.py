"""The YAML config: its schema (schema.py, composed of the rooms' own sections), the names a user may mistype
(names.py), the generated reference (reference.py), hints for common mistakes (hints.py), the chat template's
options and where a model comes from."""
from orchestrator.config.schema import ConfigError, TideConfig, dump_config, load_config, parse_config

__all__ = ["ConfigError", "TideConfig", "dump_config", "load_config", "parse_config"]
