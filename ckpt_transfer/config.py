"""The weight hand-over's settings, validated where they are consumed: the YAML `publish:` and `transfer:`
sections (the transport's own knobs, `transfer.mooncake:`, are `transport.TransferConfig`). Pydantic only:
no torch, Ray or Mooncake import."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo

from .transport import TransferConfig


def config_dir(info: ValidationInfo) -> Path:
    """The directory a config's relative paths resolve against: the validation context's `config_dir` (the
    config file's directory, set by orchestrator.config.load_config), else the working directory."""
    return Path((info.context or {}).get("config_dir") or Path.cwd())


def resolve_config_path(value: str, info: ValidationInfo) -> str:
    """`value` (~ expanded) as an absolute, normalised path; a relative one joined to `config_dir(info)`."""
    return os.path.abspath(config_dir(info) / Path(value).expanduser())


def missing_path(what: str, path: str, info: ValidationInfo) -> str:
    """The message for a resolved path that does not exist, saying where relative paths are looked for."""
    where = "the config file's directory" if (info.context or {}).get("config_dir") else "the working directory"
    return f"no such {what} {path!r} (relative paths resolve against {where} {config_dir(info)})"


# A path in the YAML. Held absolute once validated, so that the resolved config (RUN_DIR/config.yaml) means the
# same from any directory; defined here, in the lowest room whose settings name paths.
ConfigPath = Annotated[str, AfterValidator(resolve_config_path)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class PublishConfig(_Strict):
    """The YAML `publish:` section: where trainer ranks write each iteration's shards and how many are kept."""

    shm_root: ConfigPath = Field(
        "/dev/shm/tide", description="Directory (normally in shared memory) where the trainer ranks write each "
        "iteration's Hugging Face shards, under <shm_root>/<name>-<run id>/<iteration> (the run id: RUN_DIR/run_id); "
        "it needs room for keep_last + 1 iterations of weights.")
    keep_last: int = Field(2, ge=1, description="Published iterations kept in shared memory; older ones are "
                           "deleted.")
    shard_bytes: int = Field(512 * 1024**2, gt=0, description="Target size of one safetensors shard file, in bytes "
                             "(default 512 MiB).")
    writer_threads: int = Field(2, ge=1, description="Shard files each trainer rank writes at once.")


class WeightTransferConfig(_Strict):
    """The YAML `transfer:` section. Enabled: every rollout node pulls each iteration through the Mooncake
    transfer engine into its own shared memory. Off: engines read the publish directory, which needs them on
    the trainer's machine."""

    enabled: bool = Field(False, description="true: every rollout node pulls each iteration's shards through the "
                          "Mooncake transfer engine into its own shared memory; false: the engines read the publish "
                          "directory, so they must run on the trainer's machine.")
    rollout_shm_root: ConfigPath = Field(
        "/dev/shm/tide-rollout", description="Where rollout node k keeps its pulled copy: "
        "<rollout_shm_root>/rollout<k> (transfer.enabled only).")
    registry_name: str = Field("tide_shard_registry", description="Name of the Ray actor that registers published "
                               "shards (detached, so that any node can query it).")
    registry_state_path: ConfigPath | None = Field(
        None, description="File the shard registry snapshots its state to, so that a restarted registry actor "
        "reloads it; null: no snapshot.")
    mooncake: TransferConfig = Field(TransferConfig(), description="The Mooncake transport's settings "
                                     "(transfer.enabled only).")
