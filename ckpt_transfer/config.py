"""The weight hand-over's settings, validated where they are consumed: the YAML `publish:` and `transfer:`
sections (the transport's own knobs, `transfer.mooncake:`, are `transport.TransferConfig`). Pydantic only:
no torch, Ray or Mooncake import."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .transport import TransferConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class PublishConfig(_Strict):
    """The YAML `publish:` section: where trainer ranks write each iteration's shards and how many are kept."""

    shm_root: str = "/dev/shm/tide"
    keep_last: int = Field(2, ge=1)
    shard_bytes: int = Field(512 * 1024**2, gt=0)
    writer_threads: int = Field(2, ge=1)  # shard files each trainer rank writes at once


class WeightTransferConfig(_Strict):
    """The YAML `transfer:` section. Enabled: every rollout node pulls each iteration through the Mooncake
    transfer engine into its own shared memory. Off: engines read the publish directory, which needs them on
    the trainer's machine."""

    enabled: bool = False
    rollout_shm_root: str = "/dev/shm/tide-rollout"  # rollout node k keeps its copy under <root>/rollout<k>
    registry_name: str = "tide_shard_registry"
    registry_state_path: str | None = None  # snapshot file: a restarted registry actor reloads it
    mooncake: TransferConfig = TransferConfig()
