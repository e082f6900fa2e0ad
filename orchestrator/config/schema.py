"""The YAML schema. Every field is validated before anything starts; an unknown, missing or invalid field is
reported by name with what is allowed (`ConfigError`, exit code 2 in the CLI), an unknown key with the keys
meant (a near spelling at its level, the same key in another section, or TRL's and veRL's names for it:
orchestrator.config.names). `key.path=value` overrides (`tide run CONFIG trainer.lr=5e-4`) are set before
validation. Relative paths resolve against the config file's directory (ckpt_transfer.config.ConfigPath) and
are held absolute, so the resolved config (`dump_config`, RUN_DIR/config.yaml) means the same from anywhere.

Each section is defined by the room that consumes it and handed down as the validated object: `trainer:`
(trainer.config), `rollout:` and `task:` (rollout.config), `publish:` and `transfer:` (ckpt_transfer.config),
`model.tiny:` (trainer.tiny_model), `jax:` (trainer.jax.config). The sections only the orchestrator reads are
here."""
from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ckpt_transfer.config import (ConfigPath, PublishConfig, StrictModel, WeightTransferConfig, missing_path,
                                  resolve_config_path)
from orchestrator.config.hints import section_value_hint
from orchestrator.config.names import OTHER_NAMES, OtherName
from orchestrator.config.placement import PlacementConfig, check_placement
from orchestrator.config.model_source import looks_local
from orchestrator.rewards.functions import RewardSpec
from orchestrator.rewards.served_config import ServedModelConfig
from orchestrator.config.template_kwargs import ChatTemplateKwargs
from orchestrator.records.wandb_log import WandbConfig
from rollout.agent.config import AgentConfig
from rollout.config import RolloutConfig, TaskConfig
from trainer.batch import TokenDistribution
from trainer.config import LoRAConfig, TrainerConfig
from trainer.jax.config import JaxConfig
from trainer.tiny_model import TinyModelConfig


class RayConfig(StrictModel):
    address: str | None = Field(None, description="The Ray cluster: null starts a local one for the run; `auto` "
                                "or `host:port` joins one started with `ray start`.")
    num_cpus: int | None = Field(None, description="CPUs a local cluster offers; null: every core of the host.")
    namespace: str = Field("tide", description="Ray namespace of the run's actors.")
    log_to_driver: bool = Field(False, description="Print the actors' logs (vLLM, Megatron) in the terminal; "
                                "false leaves them in Ray's session log directory (RUN_DIR/ray_session/logs).")
    keep_sessions: int = Field(10, ge=0, description="Ray session directories (Ray's logs, ~0.4 MB a run) of "
                               "ended runs kept under Ray's temporary directory (/tmp/ray) when the run starts a "
                               "local cluster; older ones are removed at the next start. A joined cluster's are "
                               "left alone.")


class ModelConfig(StrictModel):
    path: str | None = Field(
        None, description="The starting weights: a local Hugging Face model directory, or a hub id such as "
        "Qwen/Qwen2.5-0.5B-Instruct where a hub is reachable; null builds the tiny model of model.tiny.")
    tiny: TinyModelConfig = Field(TinyModelConfig(), description="Architecture of the tiny model built locally "
                                  "when model.path is null.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype of trainer and engines; bfloat16 trains with mixed-precision Adam, "
        "float16 needs rollout.max_logprob_gap.")
    chat_template: str = Field(
        "auto", description="How chat-message prompts are rendered: `auto` (the tokenizer's template), `none` (the "
        "messages' contents one per line, for a base model) or the path of a .jinja file.")
    system_prompt: str | None = Field(None, description="A system message put before every chat prompt; null: "
                                      "none.")
    chat_template_kwargs: ChatTemplateKwargs = Field(
        {}, description="Variables for the chat template wherever tide renders messages (rollout, agents, "
        "evaluation, warm start, log-prob probe), as apply_chat_template's keyword arguments: {enable_thinking: "
        "false} for Qwen3. The arguments tide sets itself (tools, add_generation_prompt, tokenize, ...) are refused.")

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, value: str, info: ValidationInfo) -> str:
        if value in ("auto", "none"):
            return value
        path = resolve_config_path(value, info)
        if not Path(path).is_file():
            raise ValueError(f"'auto', 'none' or the path of a .jinja file; {missing_path('file', path, info)}")
        return path

    @field_validator("path")
    @classmethod
    def _directory_or_hub_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        """An existing directory (relative: to the config file) as its absolute path; a hub id as it is."""
        if value is None:
            return None
        path = resolve_config_path(value, info)
        if Path(path).exists():
            return path
        if looks_local(value):
            raise ValueError(f"{missing_path('directory', path, info)}; a hub id looks like 'org/name'")
        return value


class SandboxSection(StrictModel):
    """Code sandbox for `task.name: code`: `url` of a running service, or None to start one for the run."""

    url: str | None = Field(None, description="URL of a running tide-sandbox service; null: tide starts one for "
                            "the run (as root) when the task or a reward runs code.")
    state_dir: ConfigPath = Field("/run/tide-sandbox-run", description="State directory of the sandbox service "
                                  "tide starts (its containers' bundles and cgroups bookkeeping).")


class EvalConfig(StrictModel):
    """The eval phase on held-out problems (orchestrator/iteration/evaluation.py): greedy pass@1, unbiased pass@k for k
    in {1, n_samples} of completions sampled from `sampling(rollout)` (by default the run's own distribution), mean
    reward; every `every` iterations (0: never)."""

    every: int = Field(0, ge=0, description="Run the eval phase every this many iterations; 0: never.")
    prompts: int = Field(64, gt=0, description="Held-out problems per eval: the first rows of task.eval_path, or a "
                         "fixed stream of the task that training never draws.")
    n_samples: int = Field(4, gt=0, description="Sampled completions per problem, for sampled pass@1 and "
                           "pass@n_samples (greedy pass@1 takes one more).")
    temperature: float | None = Field(None, gt=0, description="Temperature of the sampled completions; null: "
                                      "rollout.temperature (the distribution the run trains on).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus of the sampled completions; null: "
                                "rollout.top_p.")
    top_k: int | None = Field(None, ge=0, description="Top-k of the sampled completions (0: all); null: "
                              "rollout.top_k.")
    max_new_tokens: int | None = Field(None, gt=0, description="Completion length cap of the eval; null: "
                                       "rollout.max_new_tokens.")

    def sampling(self, rollout: RolloutConfig) -> TokenDistribution:
        """The distribution the eval's sampled completions come from: each field unset here is the run's."""
        return TokenDistribution(temperature=rollout.temperature if self.temperature is None else self.temperature,
                                 top_p=rollout.top_p if self.top_p is None else self.top_p,
                                 top_k=rollout.top_k if self.top_k is None else self.top_k)


class LoggingConfig(StrictModel):
    """TensorBoard event files are always written (RUN_DIR/tb); `wandb` adds a Weights & Biases run
    (orchestrator/records/wandb_log.py), offline unless `mode: online`."""

    wandb: WandbConfig | None = Field(None, description="Also log every metric and phase time to a Weights & "
                                      "Biases run (needs the wandb package); null: TensorBoard only.")
    samples: int = Field(4, ge=0, description="Completions per iteration written to RUN_DIR/samples.jsonl and "
                         "shown as TensorBoard text (prompt, completion, reward); 0: none.")
    no_signal_after: int = Field(3, ge=0, description="Warn (console, status.json `warning`) once every prompt's "
                                 "samples got one same reward this many iterations in a row: zero advantages, "
                                 "nothing learned; the warning names the reward functions that returned one constant "
                                 "value. 0: never.")

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, value: WandbConfig | None) -> WandbConfig | None:
        import importlib.util

        if value is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError("the wandb package is not installed: `pip install wandb`, or remove logging.wandb")
        return value


class TideConfig(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="The run's name; the run directory defaults to "
                      "runs/<name> under the working directory.")
    engine: Literal["megatron", "jax"] = Field(
        "megatron", description="`megatron`: RL post-training of an LLM (Megatron-core trainer, vLLM rollout); "
        "`jax`: the JAX engine on simulated environments (reads the `jax:` section).")
    seed: int = Field(0, description="Seed of everything random in the run: data order, sampling, initial "
                      "weights.")
    deterministic: bool = Field(True, description="Deterministic kernels and seeded sampling, so that a run "
                                "killed and resumed ends as an uninterrupted one would.")
    iterations: int = Field(gt=0, description="Iterations to run (rollout, reward, train, publish, sync; one "
                            "jitted chunk with engine jax).")
    save_every: int = Field(5, ge=1, description="Save a checkpoint every this many iterations, and after the "
                            "last.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept in RUN_DIR/checkpoints; older ones are "
                                  "deleted.")
    run_dir: ConfigPath | None = Field(None, description="The run directory; null: runs/<name> under the working "
                                       "directory. `tide run --run-dir` overrides it.")
    ray: RayConfig = Field(RayConfig(), description="The Ray cluster the run's actors live in.")
    model: ModelConfig = Field(ModelConfig(), description="The model trained and served: its weights, dtype and "
                               "how chat prompts are rendered.")
    task: TaskConfig = Field(TaskConfig(), description="Where prompts come from and how completions are scored.")
    trainer: TrainerConfig = Field(TrainerConfig(), description="The Megatron-core trainer: layout, RL loss, "
                                   "optimizer, supervised warm start.")
    rollout: RolloutConfig = Field(RolloutConfig(), description="The vLLM engines and what each rollout phase "
                                   "samples.")
    placement: PlacementConfig = Field(PlacementConfig(), description="Whether engines and trainer ranks share "
                                       "cores (or GPUs) or get their own.")
    publish: PublishConfig = Field(PublishConfig(), description="Where each iteration's weights are published "
                                   "as Hugging Face shards in shared memory.")
    transfer: WeightTransferConfig = Field(WeightTransferConfig(), description="Moving published weights to "
                                           "rollout nodes over the Mooncake transfer engine.")
    sandbox: SandboxSection = Field(SandboxSection(), description="The code sandbox, for task.name code and the "
                                    "`code` reward.")
    eval: EvalConfig = Field(EvalConfig(), description="The eval phase on held-out problems: greedy pass@1, "
                             "sampled pass@1 and pass@n_samples, mean reward.")
    agent: AgentConfig | None = Field(None, description="Multi-turn rollouts: tool calls or an environment "
                                      "answering each turn; null: one completion per prompt.")
    models: dict[str, ServedModelConfig] = Field({}, description="Second models served for the run by name "
                                                 "(reward models), for `rewards:` entries' `model:`.")
    rewards: list[RewardSpec] = Field([], description="Reward functions replacing the task's scorer: a sample's "
                                      "reward is the weighted sum of their values; empty: the task's own scorer.")
    reward_timeout_s: float = Field(60.0, gt=0, description="Seconds a reward function may take on a batch "
                                    "before the run stops, naming it.")
    jax: JaxConfig | None = Field(None, description="The JAX engine's settings; required with engine jax, refused "
                                  "otherwise.")
    logging: LoggingConfig = Field(LoggingConfig(), description="Metrics and sample logging (TensorBoard always, "
                                   "W&B optionally).")

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
            if r.max_staleness and r.mismatch_correction == "none" and self.trainer.loss == "grpo":
                # Kimi k1.5's objective is a mirror-descent step from the policy that sampled: its pi_old is the
                # behaviour policy by definition, and stale samples need no other. The clipped surrogate's is the
                # trainer's policy before the update (decoupled PPO's proximal policy).
                raise ValueError(f"rollout.max_staleness {r.max_staleness} trains on samples of an older policy: set "
                                 f"rollout.mismatch_correction (tis, mis or icepop), so that the trainer recomputes "
                                 f"pi_old and weighs each token by pi_old / pi_behaviour (loss kimi needs none: its "
                                 f"pi_old is the policy that sampled)")
            if r.weight_update == "in_flight":
                if self.deterministic and r.in_flight_step is None:
                    raise ValueError("rollout.weight_update in_flight with deterministic true needs "
                                     "rollout.in_flight_step: the decode step at which the engines take the new "
                                     "weights, so that which version samples which token does not depend on timing")
                if self.agent is not None:
                    raise ValueError("rollout.weight_update in_flight with `agent:` is not built (a trajectory's "
                                     "turns are separate generate calls): use drain")
                if self.trainer.lora is not None and self.trainer.lora.syncs_adapter:
                    raise ValueError("rollout.weight_update in_flight with trainer.lora.sync adapter is not built "
                                     "(the engines take new weights mid-generate, not a new adapter): use "
                                     "trainer.lora.sync merged, or weight_update drain")
            if r.proximal == "loglinear" and self.trainer.loss != "grpo":
                raise ValueError(f"rollout.proximal loglinear approximates decoupled PPO's proximal policy, loss "
                                 f"grpo's pi_old; loss {self.trainer.loss} takes the policy that sampled as its "
                                 f"pi_old: remove it")
            check_placement(self.placement, self.trainer, r, self.transfer.enabled)
            if self.agent is not None:
                if r.partial_rollout and self.agent.uses_sandbox:
                    raise ValueError("rollout.partial_rollout with agent.tools python or agent.environment "
                                     "code_feedback is not built: a trajectory set aside is saved with the checkpoint, "
                                     "and their state lives in the sandbox service, which a checkpoint does not hold")
                if r.stop:
                    raise ValueError("rollout.stop with `agent:` is not built: the engine cuts a stop string out of a "
                                     "turn's text while the sampled tokens keep it, so the text the tool parser reads "
                                     "and the template re-renders would not be the tokens trained on. A turn ends at "
                                     "the chat template's end-of-turn token: remove rollout.stop")
                if self.agent.environment is not None and self.rewards:
                    raise ValueError("rewards: agent.environment scores its trajectories itself; remove `rewards:` or "
                                     "use agent.tools")
            _check_served_models(self.models, self.rewards)
            if self.trainer.length_penalty > 0 and self.rewards:
                raise ValueError("trainer.length_penalty shapes the task's own reward; with `rewards:` add "
                                 "{fn: length, weight: ...} to the list instead")
        return self

    def needs_sandbox(self) -> bool:
        return (self.task.name == "code" or any(r.fn == "code" for r in self.rewards)
                or (self.agent is not None and self.agent.uses_sandbox))


# Sections that configure the LLM loop (engine: megatron) and mean nothing to the JAX engine.
LLM_SECTIONS = frozenset({"ray", "placement", "model", "task", "trainer", "rollout", "publish", "transfer", "sandbox",
                          "eval", "agent", "rewards", "reward_timeout_s", "models"})


def _check_served_models(models: Mapping[str, ServedModelConfig], rewards: list[RewardSpec]) -> None:
    """Every `model:` a reward names is served, and every served model scores something."""
    for name in models:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"models: {name!r}: a served model's name has letters, digits, '_', '.' and '-' only")
    named = {r.model for r in rewards if r.model is not None}
    unknown = sorted(named - set(models))
    if unknown:
        raise ValueError(f"rewards: model {unknown[0]!r} is not served: the `models:` section serves "
                         f"{', '.join(sorted(models)) or 'nothing'}")
    unused = sorted(set(models) - named)
    if unused:
        raise ValueError(f"models: {unused[0]!r} is served but no reward uses it (`rewards: - {{model: "
                         f"{unused[0]}}}`): remove it, or score with it")


class ConfigError(Exception):
    """A config file that cannot be used; the message names the field and what is allowed."""


def submodel(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """The model a field's annotation holds (a section, an optional section or a list of items), and whether
    it is a list's items."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    for arg in get_args(annotation):
        found = submodel(arg)
        if found is not None:
            return found[0], found[1] or get_origin(annotation) is list
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def sections(model: type[BaseModel] = TideConfig, prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """Every section under `model`, depth first in field order: ("", TideConfig), ("ray", RayConfig), ...,
    ("trainer.kl", KLConfig), ...; a list's items are `name[]` ("rewards[]")."""
    yield prefix, model
    for name, field in model.model_fields.items():
        found = submodel(field.annotation)
        if found is not None:
            yield from sections(found[0], _join(prefix, name) + ("[]" if found[1] else ""))


def _keys_by_name() -> dict[str, list[str]]:
    """Every key's dotted path, by its own name ("lr": ["trainer.lr", "jax.lr"])."""
    keys: dict[str, list[str]] = {}
    for prefix, model in sections():
        for name in model.model_fields:
            keys.setdefault(name, []).append(_join(prefix, name))
    return keys


KEYS_BY_NAME = _keys_by_name()


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model of the section at an error's location (list indices skipped)."""
    model: type[BaseModel] = TideConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        found = submodel(field.annotation) if field is not None else None
        if found is None:
            return None
        model = found[0]
    return model


def _flatten(value: Any, prefix: str) -> Iterator[str]:
    yield prefix
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}")


def _other_names(loc: tuple, value: Any) -> list[OtherName]:
    """TRL's or veRL's names among an unknown key and the keys under it: those ending with its dotted path
    (`rollout.n`, `data.train_batch_size`), else, for a name tide does not use itself, those named as it is
    (`learning_rate`, `trainer.ppo_epochs`)."""
    key, dotted = str(loc[-1]), ".".join(str(p) for p in loc if not isinstance(p, int))
    paths = [p for p in _flatten(value, dotted) if "." in p]
    hits = [o for o in OTHER_NAMES if any(o.name == p or o.name.endswith("." + p) for p in paths)]
    if hits or key in KEYS_BY_NAME:
        return hits
    return [o for o in OTHER_NAMES if o.leaf == key]


def _suggestions(loc: tuple, value: Any) -> list[str]:
    """The keys an unknown key may have meant: TRL's or veRL's names for a tide key, the same name in another
    section, and near spellings at its level."""
    key, prefix = str(loc[-1]), ".".join(str(p) for p in loc[:-1])
    here = _model_at(loc[:-1])
    meant: dict[str, str] = {}
    for o in _other_names(loc, value):
        meant.setdefault(o.tide, o.hint())
    near = difflib.get_close_matches(key, list(here.model_fields) if here else [], cutoff=0.7)
    for k in KEYS_BY_NAME.get(key, []) + [_join(prefix, k) for k in near]:
        meant.setdefault(k, k)
    return list(meant.values())


def _message(e: Mapping[str, Any]) -> str:
    loc = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        meant = _suggestions(e["loc"], e.get("input"))
        return f"{loc}: unknown field" + (f"; did you mean {', '.join(meant)}?" if meant else "")
    if e["type"] == "missing":
        return f"{loc}: required field is missing"
    if e["type"] == "model_type" and (section := _model_at(e["loc"])) is not None:  # `trainer.kl: 0.05`
        return section_value_hint(loc, section, e.get("input"))
    msg = e["msg"].removeprefix("Value error, ")
    if not loc or msg.startswith(f"{loc}."):  # a section's own check names its fields
        return msg
    value = e.get("input")
    return f"{loc}: {msg}" + ("" if isinstance(value, (Mapping, list)) else f" (got {value!r})")


def _format(err: ValidationError, source: str) -> str:
    errors = err.errors()
    lines = [f"invalid config {source}:", *(f"  {_message(e)}" for e in errors)]
    if any(e["type"] == "extra_forbidden" for e in errors):
        lines.append("every key with its default: `tide config show CONFIG`; described in docs/config.md")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<dict>", config_dir: str | Path | None = None) -> TideConfig:
    """`data` validated; relative paths in it resolve against `config_dir` (None: the working directory)."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
    try:
        return TideConfig.model_validate(data, context={"config_dir": str(config_dir) if config_dir else None})
    except ValidationError as err:
        raise ConfigError(_format(err, source)) from None


class _OverrideLoader(yaml.SafeLoader):
    """YAML as safe_load reads it, plus YAML 1.2's floats without a dot: 5e-4 is a number, not a string."""


_OverrideLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                      list("-+0123456789."))


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`key.path=value` arguments as {key.path: value}, each value read as YAML."""
    out: dict[str, Any] = {}
    for arg in args:
        key, eq, text = arg.partition("=")
        if not eq or not key or "" in key.split("."):
            raise ConfigError(f"override {arg!r}: expected key.path=value (trainer.lr=5e-4, rewards.0.weight=0.5)")
        try:
            out[key] = yaml.load(text, Loader=_OverrideLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {arg!r}: the value is not valid YAML: {err}") from None
    return out


def set_key(data: dict, key: str, value: Any) -> None:
    """Sets `key` (dotted: `trainer.kl.coef`; list items by index: `rewards.0.weight`) in `data`, creating
    the mappings on the way that are missing (or null)."""
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts):
        at = ".".join(parts[:depth]) or "the top level"
        index: str | int = part
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                span = f": index it by number (0 to {len(node) - 1})" if node else ""
                raise ConfigError(f"override {key}: {at} is a list of {len(node)} item(s){span}")
            index = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"override {key}: {at} is {node!r}, not a mapping")
        if depth == len(parts) - 1:
            node[index] = value
            return
        if isinstance(node, dict) and node.get(index) is None:
            node[index] = {}
        node = node[index]


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> TideConfig:
    """The config file at `path` with `overrides` ({dotted key: value}) set, validated; its relative paths
    resolve against its directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML in {path}: {err}") from None
    if overrides and (data is None or isinstance(data, dict)):
        data = data or {}
        for key, value in overrides.items():
            set_key(data, key, value)
    return parse_config(data, str(path), config_dir=Path(os.path.abspath(path)).parent)


def dump_config(cfg: TideConfig) -> str:
    """The resolved config (every default filled in) with only the sections its engine reads, so that it
    loads back unchanged (`tide resume`); without `model.tiny` where a model.path is given (no tiny model is built)."""
    data = cfg.model_dump(mode="json")
    if cfg.model.path is not None:
        del data["model"]["tiny"]
    unused = LLM_SECTIONS if cfg.engine == "jax" else {"jax"}
    return yaml.safe_dump({k: v for k, v in data.items() if k not in unused}, sort_keys=False)


def engine_lora(lora: LoRAConfig | None):
    """What the engines need to serve trainer.lora's adapters (None unless trainer.lora.sync is adapter)."""
    if lora is None or not lora.syncs_adapter:
        return None
    from rollout.config import EngineLoRAConfig

    return EngineLoRAConfig(rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules)
