"""The weight hand-over's settings, validated where they are consumed: the YAML `publish:` and `transfer:`
sections, and the Mooncake transport's own knobs (`transfer.mooncake:`, `TransferConfig`). Pydantic only:
no torch, Ray or Mooncake import."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

P2P_HANDSHAKE = "P2PHANDSHAKE"  # peers find each other directly, with no metadata server


def config_dir(info: ValidationInfo) -> Path:
    """The directory a config's relative paths resolve against: the validation context's `config_dir` (the
    config file's directory, set by orchestrator.config.schema.load_config), else the working directory."""
    return Path((info.context or {}).get("config_dir") or Path.cwd())


def resolve_config_path(value: str, info: ValidationInfo) -> str:
    """`value` (~ expanded) as an absolute, normalised path; a relative one joined to `config_dir(info)`."""
    return os.path.abspath(config_dir(info) / Path(value).expanduser())


def missing_path(what: str, path: str, info: ValidationInfo) -> str:
    """The message for a resolved path that does not exist, saying where relative paths are looked for."""
    where = "the config file's directory" if (info.context or {}).get("config_dir") else "the working directory"
    return f"no such {what} {path!r} (relative paths resolve against {where} {config_dir(info)})"


NODE_SHM_ROOT_ENV = "TIDE_SHM_ROOT"


def node_shm_root(configured: str) -> str:
    """The publish root on the node this process runs on: `publish.shm_root`, unless the node's environment names
    its own in TIDE_SHM_ROOT. Set per node where several Ray nodes share one host (a simulated cluster: each raylet
    started with its own), so that each keeps what its trainer ranks own apart, as separate machines would."""
    return os.environ.get(NODE_SHM_ROOT_ENV) or configured


# A path in the YAML. Held absolute once validated, so that the resolved config (RUN_DIR/config.yaml) means the
# same from any directory; defined here, in the lowest room whose settings name paths.
ConfigPath = Annotated[str, AfterValidator(resolve_config_path)]


class StrictModel(BaseModel):
    """A section of the YAML (or a message built from one): a key it does not define is an error, never ignored,
    so that a misspelt setting cannot silently leave its default in force. The base of every room's config models,
    defined here with ConfigPath, in the lowest room whose settings are read from the config."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class PublishConfig(StrictModel):
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


class TransferConfig(StrictModel):
    """Transport settings (the YAML `transfer.mooncake:` section)."""

    protocol: Literal["tcp", "rdma"] = Field("tcp", description="How nodes exchange shards: `tcp`, or `rdma` "
                                             "(InfiniBand/RoCE; name the NICs in device_names).")
    device_names: list[str] = Field(default_factory=list, description="RDMA devices to use with protocol rdma, "
                                    "e.g. [\"mlx5_0\", \"mlx5_1\"]; ignored with tcp.")
    handshake: str = Field(P2P_HANDSHAKE, description="How peers find each other: `P2PHANDSHAKE` (directly, no "
                           "metadata server) or a metadata server such as `etcd://10.0.0.1:2379`.")
    local_host: str = Field("127.0.0.1", description="The IP address other nodes reach this node's transfer "
                            "engine on; `auto`: the address Ray knows the node by (clusters: every node agent "
                            "then uses its own node's).")
    bucket_bytes: int = Field(64 << 20, ge=4096, description="Bytes per read request: files are read in buckets "
                              "of this size.")
    concurrency: int = Field(4, ge=1, description="Read requests in flight per pull, across shards and peers; at "
                             "most max_entries_per_batch.")
    max_entries_per_batch: int = Field(1024, ge=1, le=1024, description="Most entries queued per peer (the TCP "
                                       "transport takes at most 1024).")
    retries: int = Field(2, ge=0, description="Extra attempts per file after a failed first one.")
    retry_backoff_s: float = Field(0.2, ge=0, description="Seconds to wait before retrying a failed file.")
    timeout_s: float = Field(30.0, gt=0, description="Seconds allowed for the handshake and the file-table read, "
                             "and per pull attempt plus its bytes / min_bytes_per_s.")
    min_bytes_per_s: float = Field(100e6, gt=0, description="Slowest pull rate tolerated, in bytes per second "
                                   "(sets a pull attempt's deadline with timeout_s).")
    poll_interval_s: float = Field(0.001, ge=0, description="Seconds between polls of a read's status.")
    verify_threads: int = Field(2, ge=1, description="Threads that checksum pulled files (files are spread over "
                                "them; one file is checked in order).")
    unmap_grace_s: float = Field(10.0, ge=0, description="Seconds a file no longer served stays mapped, so that "
                                 "reads already in flight complete.")
    table_bytes: int = Field(4 << 20, ge=4096, description="Size in bytes of the buffer that lists the files a "
                             "node serves.")
    log_level: str = Field("WARNING", description="Mooncake's log level (MC_LOG_LEVEL: INFO, WARNING, ERROR, ...) "
                           "unless the environment sets one.")
    # No gain measured on loopback, and the faulting is serial, before any read starts.
    prefault: bool = Field(False, description="Fault in the destination files' pages (MAP_POPULATE) before "
                           "reading into them.")

    @model_validator(mode="after")
    def _check(self) -> "TransferConfig":
        if self.concurrency > self.max_entries_per_batch:
            raise ValueError("concurrency must not exceed max_entries_per_batch (<= 1024 per peer)")
        return self



class WeightTransferConfig(StrictModel):
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
