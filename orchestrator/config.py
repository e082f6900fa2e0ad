"""The YAML schema. Every field is validated before anything starts; an unknown, missing or invalid field is
reported by name with what is allowed (`ConfigError`, exit code 2 in the CLI).

Each section is defined by the room that consumes it and handed down as the validated object: `trainer:`
(trainer.config), `rollout:` and `task:` (rollout.config), `publish:` and `transfer:` (ckpt_transfer.config),
`model.tiny:` (trainer.tiny_model), `jax:` (trainer.jax.config). The sections only the orchestrator reads are
here."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckpt_transfer.config import PublishConfig, WeightTransferConfig
from orchestrator.model_source import looks_local
from orchestrator.reward_functions import RewardSpec
from orchestrator.wandb_log import WandbConfig
from rollout.config import RolloutConfig, TaskConfig
from trainer.config import TrainerConfig
from trainer.jax.config import JaxConfig
from trainer.tiny_model import TinyModelConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class RayConfig(Strict):
    address: str | None = None  # None: start a local cluster; "auto" or "host:port" joins one
    num_cpus: int | None = None
    namespace: str = "tide"
    log_to_driver: bool = False  # actor logs (vLLM, Megatron) stay in Ray's session log directory


class ModelConfig(Strict):
    path: str | None = None  # an HF directory (or hub id where a hub is reachable); None builds `tiny`
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # How chat-message prompts are rendered (orchestrator/prompts.py): auto (the tokenizer's template), none, or
    # a .jinja file
    chat_template: str = "auto"
    system_prompt: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _template_file_exists(cls, value: str) -> str:
        if value not in ("auto", "none") and not Path(value).expanduser().is_file():
            raise ValueError(f"'auto', 'none' or the path of a .jinja file; no such file {value!r}")
        return value

    @field_validator("path")
    @classmethod
    def _local_path_exists(cls, path: str | None) -> str | None:
        if path is not None and looks_local(path) and not Path(path).expanduser().exists():
            raise ValueError(f"no such directory {path!r} (a hub id looks like 'org/name')")
        return path


class SandboxSection(Strict):
    """Code sandbox for `task.name: code`: `url` of a running service, or None to start one for the run."""

    url: str | None = None
    state_dir: str = "/run/tide-sandbox-run"


class EvalConfig(Strict):
    """The eval phase on held-out problems (orchestrator/evaluation.py): greedy pass@1, unbiased pass@k for k in
    {1, n_samples} at `temperature`, mean reward; every `every` iterations (0: never)."""

    every: int = Field(0, ge=0)
    prompts: int = Field(64, gt=0)
    n_samples: int = Field(4, gt=0)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int | None = Field(None, gt=0)  # None: rollout.max_new_tokens


class LoggingConfig(Strict):
    """TensorBoard event files are always written (RUN_DIR/tb); `wandb` adds a Weights & Biases run
    (orchestrator/wandb_log.py), offline unless `mode: online`."""

    wandb: WandbConfig | None = None

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, value: WandbConfig | None) -> WandbConfig | None:
        import importlib.util

        if value is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError("the wandb package is not installed: `pip install wandb`, or remove logging.wandb")
        return value


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
    transfer: WeightTransferConfig = WeightTransferConfig()
    sandbox: SandboxSection = SandboxSection()
    eval: EvalConfig = EvalConfig()
    # Reward functions replacing the task's scorer (orchestrator/reward_functions.py); empty: the task's own
    rewards: list[RewardSpec] = []
    reward_timeout_s: float = Field(60.0, gt=0)
    jax: JaxConfig | None = None
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _engine_sections(self) -> "TideConfig":
        """A section the chosen engine would not read is refused, never silently ignored."""
        if self.engine == "jax":
            if self.jax is None:
                raise ValueError("engine 'jax' needs a `jax:` section")
            unused = sorted(self.model_fields_set & LLM_SECTIONS)
            if unused:
                raise ValueError(f"engine 'jax' does not use the section(s) {', '.join(unused)}: remove them "
                                 f"(they configure the LLM engine, `engine: megatron`)")
        elif self.jax is not None:
            raise ValueError("the `jax:` section is read only with `engine: jax`: remove it or set engine: jax")
        else:
            p, r = self.trainer.parallel, self.rollout
            r.logprob_gap_bound(self.model.dtype)  # float16 has no default bound: refused here, not mid-run
            per_step = r.prompts_per_iteration * r.n_samples // self.trainer.updates_per_iteration
            if per_step < p.dp * p.ep:
                raise ValueError(f"each optimizer step gets {per_step} samples (rollout.prompts_per_iteration x "
                                 f"n_samples / trainer.updates_per_iteration), fewer than the {p.dp * p.ep} "
                                 f"data-parallel replicas (trainer.parallel.dp x ep) that split them")
            if self.trainer.length_penalty > 0 and self.rewards:
                raise ValueError("trainer.length_penalty shapes the task's own reward; with `rewards:` add "
                                 "{fn: length, weight: ...} to the list instead")
        return self

    def needs_sandbox(self) -> bool:
        return self.task.name == "code" or any(r.fn == "code" for r in self.rewards)


# Sections that configure the LLM loop (engine: megatron) and mean nothing to the JAX engine.
LLM_SECTIONS = frozenset({"ray", "model", "task", "trainer", "rollout", "publish", "transfer", "sandbox",
                          "eval", "rewards", "reward_timeout_s"})


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
    """The resolved config (every default filled in) with only the sections its engine reads, so that it
    loads back unchanged (`tide resume`)."""
    data = cfg.model_dump(mode="json")
    unused = LLM_SECTIONS if cfg.engine == "jax" else {"jax"}
    return yaml.safe_dump({k: v for k, v in data.items() if k not in unused}, sort_keys=False)
