"""Checkpoint hand-over from trainer to rollout. The orchestrator's door is `WeightSync` (publish, pull,
verify, gc; `open_weight_sync` picks shared memory or Mooncake from the config); below it: Megatron <-> HF
conversion (`convert`), the shared-memory shard writer, the shard manifest, TP re-slicing, checksums, the
shard registry, the Mooncake transport and per-node agents, and garbage collection. Importing the package
imports neither torch, Ray nor Mooncake; import the submodules for those."""
from .checksum import ShardVerificationError, checksum_file, verify_shard
from .config import PublishConfig, WeightTransferConfig
from .manifest import MANIFEST_FILE, Manifest, ShardRecord, TensorRecord
from .verify import CheckpointError, verify_manifest
from .weight_sync import AgentPlacement, Delivery, MooncakeSync, SharedMemorySync, WeightSync, open_weight_sync

__all__ = ["Manifest", "ShardRecord", "TensorRecord", "MANIFEST_FILE", "checksum_file", "verify_shard",
           "ShardVerificationError", "CheckpointError", "verify_manifest", "PublishConfig", "WeightTransferConfig",
           "WeightSync", "SharedMemorySync", "MooncakeSync", "Delivery", "open_weight_sync", "AgentPlacement"]
