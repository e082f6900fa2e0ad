"""Checkpoint hand-over from trainer to rollout: Megatron <-> HF conversion (`convert`), the shared-memory
shard writer, the shard manifest, TP re-slicing, checksums, the shard registry, the Mooncake transport and
per-node agents, and garbage collection. Importing the package imports neither torch, Ray nor Mooncake;
import the submodules for those."""
from .checksum import ShardVerificationError, checksum_file, verify_shard
from .manifest import MANIFEST_FILE, Manifest, ShardRecord, TensorRecord

__all__ = ["Manifest", "ShardRecord", "TensorRecord", "MANIFEST_FILE", "checksum_file", "verify_shard",
           "ShardVerificationError"]
