"""The YAML schema. Every field is validated before anything starts; an unknown, missing or invalid field is
reported by name with what is allowed (`ConfigError`, exit code 2 in the CLI)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ckpt_transfer.transport import TransferConfig
from trainer.jax.config import JaxConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class RayConfig(Strict):
    address: str | None = None  # None: start a local cluster; "auto" or "host:port" joins one
    num_cpus: int | None = None
    namespace: str = "tide"
    log_to_driver: bool = False  # actor logs (vLLM, Megatron) stay in Ray's session log directory


class TinyModelConfig(Strict):
    """Architecture of the locally built model used when `model.path` is absent."""

    architecture: Literal["qwen2", "mixtral"] = "qwen2"
    num_experts: int = Field(4, gt=0)  # mixtral only
    experts_per_token: int = Field(2, gt=0)
    hidden_size: int = Field(64, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(128, gt=0)
    max_position_embeddings: int = Field(256, gt=0)
    tie_word_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)


class ModelConfig(Strict):
    path: str | None = None  # an HF directory (or hub id where a hub is reachable); None builds `tiny`
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class TaskConfig(Strict):
    name: Literal["addition", "reverse", "jsonl", "code"] = "addition"
    path: str | None = None  # for `jsonl`: lines of {"prompt": ..., "answer": ...}
    max_digits: int = Field(2, gt=0)  # addition operand size
    length: int = Field(3, gt=0)  # reverse: string length

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> "TaskConfig":
        if self.name == "jsonl" and not self.path:
            raise ValueError("task.path is required when task.name is 'jsonl'")
        return self


class ParallelConfig(Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)


class TrainerConfig(Strict):
    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["gloo", "nccl"] = "gloo"
    parallel: ParallelConfig = ParallelConfig()
    loss: Literal["kimi", "grpo", "ppo_clip"] = "kimi"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    kimi_tau: float = Field(0.1, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    length_penalty: float = Field(0.0, ge=0)  # weight of Kimi k1.5's length reward; 0 disables it
    micro_batch_size: int = Field(64, gt=0)
    updates_per_iteration: int = Field(1, ge=1)  # optimizer steps per iteration (consecutive mini-batches)
    warmup_sft_steps: int = Field(0, ge=0)
    warmup_sft_batch: int = Field(64, gt=0)
    warmup_sft_lr: float = Field(3e-3, gt=0)


class RolloutConfig(Strict):
    engines: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    prompts_per_iteration: int = Field(32, gt=0)
    n_samples: int = Field(8, gt=0)
    max_new_tokens: int = Field(8, gt=0)
    temperature: float = Field(1.0, gt=0)
    sync_mode: Literal["restart", "reload"] = "reload"
    max_logprob_gap: float = Field(1e-4, gt=0)
    probe_prompts: int = Field(8, gt=0)
    kv_cache_gb: float = Field(0.25, gt=0)
    max_engine_restarts: int = Field(3, ge=0)  # per phase, when the engine process dies
    engine_start_timeout_s: float = Field(600, gt=0)


class PublishConfig(Strict):
    shm_root: str = "/dev/shm/tide"
    keep_last: int = Field(2, ge=1)
    shard_bytes: int = Field(512 * 1024**2, gt=0)
    writer_threads: int = Field(2, ge=1)  # shard files each trainer rank writes at once


class MooncakeSection(TransferConfig):
    model_config = ConfigDict(extra="forbid")


class TransferSection(Strict):
    """Move weights to rollout nodes through the Mooncake transfer engine (off: engines read the publish
    directory, which needs them on the trainer's machine)."""

    enabled: bool = False
    rollout_shm_root: str = "/dev/shm/tide-rollout"  # rollout node k keeps its copy under <root>/rollout<k>
    registry_name: str = "tide_shard_registry"
    registry_state_path: str | None = None  # snapshot file: a restarted registry actor reloads it
    mooncake: MooncakeSection = MooncakeSection()


class SandboxSection(Strict):
    """Code sandbox for `task.name: code`: start a local service for the run, or use `url`."""

    start: bool = True
    url: str | None = None
    state_dir: str = "/run/tide-sandbox-run"


class TideConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    engine: Literal["megatron", "jax"] = "megatron"
    seed: int = 0
    deterministic: bool = True
    iterations: int = Field(gt=0)
    save_every: int = Field(5, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    run_dir: str | None = None
    ray: RayConfig = RayConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    trainer: TrainerConfig = TrainerConfig()
    rollout: RolloutConfig = RolloutConfig()
    publish: PublishConfig = PublishConfig()
    transfer: TransferSection = TransferSection()
    sandbox: SandboxSection = SandboxSection()
    jax: JaxConfig | None = None

    @model_validator(mode="after")
    def _engine_sections(self) -> "TideConfig":
        if self.engine == "jax" and self.jax is None:
            raise ValueError("engine 'jax' needs a `jax:` section")
        if self.trainer.device == "cpu" and self.trainer.backend != "gloo":
            raise ValueError("trainer.backend must be 'gloo' when trainer.device is 'cpu'")
        return self


class ConfigError(Exception):
    """A config file that cannot be used; the message names the field and what is allowed."""


def _format(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(TideConfig, e["loc"][:-1])
            allowed = ", ".join(sorted(parent.model_fields)) if parent else "?"
            lines.append(f"  {loc}: unknown field (allowed here: {allowed})")
        elif e["type"] == "missing":
            lines.append(f"  {loc}: required field is missing")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def parse_config(data: Any, source: str = "<dict>") -> TideConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
    try:
        return TideConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, source)) from None


def load_config(path: str | Path, overrides: dict | None = None) -> TideConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML in {path}: {err}") from None
    if overrides:
        data = {**(data or {}), **overrides}
    return parse_config(data, str(path))


def dump_config(cfg: TideConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
