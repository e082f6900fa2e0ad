"""The YAML schema: bad input is reported by field name, with what is allowed, and exit code 2."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.schema import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def _base():
    return {"name": "t", "iterations": 2}


SHIPPED = sorted([*(ROOT / "configs").glob("*.yaml"), *(ROOT / "configs" / "models").glob("*.yaml")])


def _load_shipped(path: Path, tmp_path: Path):
    """A shipped config as `tide run` loads it; one whose model is the RUN_DIR/hf another shipped config's run
    leaves (configs/lora.yaml: runs/lora_base/hf) with an empty stand-in for that directory, and one serving the
    reward model or judge a script writes (configs/reward_model.yaml, configs/judge.yaml: scripts/train_*.py) with a
    stand-in holding a config.json."""
    raw = yaml.safe_load(path.read_text())
    overrides = {}
    for name, served in (raw.get("models") or {}).items():
        made = Path(os.path.abspath(path.parent / served["path"]))
        assert made.parent.parent == ROOT / "runs", made
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text("{}")
        overrides[f"models.{name}.path"] = str(tmp_path / name)
    model_path = (raw.get("model") or {}).get("path")
    made = Path(os.path.abspath(path.parent / model_path)) if model_path else None
    if made is None or made.parent.parent != ROOT / "runs":
        return load_config(path, overrides)
    assert made.name == "hf" and (ROOT / "configs" / f"{made.parent.name}.yaml").is_file(), made
    (tmp_path / "hf").mkdir(exist_ok=True)
    return load_config(path, {**overrides, "model.path": str(tmp_path / "hf")})


def test_shipped_configs_validate(tmp_path):
    for path in SHIPPED:
        _load_shipped(path, tmp_path)


def test_the_lora_config_names_the_base_its_base_config_makes():
    """configs/lora.yaml adapts runs/lora_base/hf (`tide run configs/lora_base.yaml`): without it, the error names
    the directory."""
    base = load_config(ROOT / "configs" / "lora_base.yaml")
    assert base.name == "lora_base" and base.trainer.lora is None and base.model.tiny is not None
    if not (ROOT / "runs" / "lora_base" / "hf").exists():
        with pytest.raises(ConfigError, match=re.escape(str(ROOT / "runs" / "lora_base" / "hf"))):
            load_config(ROOT / "configs" / "lora.yaml")
    raw = yaml.safe_load((ROOT / "configs" / "lora.yaml").read_text())
    assert os.path.abspath(ROOT / "configs" / raw["model"]["path"]) == str(ROOT / "runs" / "lora_base" / "hf")


def test_unknown_field_names_field_and_allowed():
    with pytest.raises(ConfigError) as e:
        parse_config({**_base(), "rollout": {"n_sampels": 4}})
    msg = str(e.value)
    assert "rollout.n_sampels: unknown field" in msg and "n_samples" in msg


def test_missing_field():
    with pytest.raises(ConfigError, match="iterations: required field is missing"):
        parse_config({"name": "t"})


def test_invalid_value_names_allowed_values():
    with pytest.raises(ConfigError) as e:
        parse_config({**_base(), "rollout": {"sync_mode": "hot"}})
    assert "rollout.sync_mode" in str(e.value) and "'restart'" in str(e.value) and "'reload'" in str(e.value)


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="gloo"):
        parse_config({**_base(), "trainer": {"device": "cpu", "backend": "nccl"}})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_cli_exits_2_before_starting_anything(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**_base(), "trainer": {"lr": -1}}))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(cfg),
                           "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "trainer.lr" in proc.stderr and "greater than 0" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_the_cli_reads_a_config_without_importing_torch():
    """A command that only reads its config (config show, a refused run) does not wait for torch to import (1.1 s
    of `tide config show`'s 1.5 s): neither the CLI nor the schema imports it."""
    code = ("import sys; import orchestrator.run.cli; from orchestrator.config import load_config; "
            f"load_config({str(ROOT / 'configs' / 'chat_dataset.yaml')!r}); "
            "assert not {'torch', 'vllm', 'megatron'} & {m.split('.')[0] for m in sys.modules}, 'imported torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _jax_base():
    return {"name": "j", "iterations": 2, "engine": "jax", "jax": {"env": "CartPole-v1"}}


@pytest.mark.parametrize("section", ["trainer", "rollout", "publish", "transfer", "model", "task", "sandbox", "ray"])
def test_jax_engine_refuses_llm_sections_by_name(section):
    with pytest.raises(ConfigError, match=rf"engine 'jax' does not use the section\(s\) {section}"):
        parse_config({**_jax_base(), section: {}})


def test_jax_section_needs_engine_jax():
    with pytest.raises(ConfigError, match="`jax:` section is read only with `engine: jax`"):
        parse_config({**_base(), "jax": {"env": "CartPole-v1"}})


def test_cli_exits_2_on_jax_config_with_llm_section(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**_jax_base(), "rollout": {"n_samples": 4}}))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(cfg),
                           "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "does not use the section(s) rollout" in proc.stderr


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_resolved_config_loads_back_unchanged(path, tmp_path):
    """`tide resume` reads the run directory's config.yaml: the dump of every shipped config must parse back
    to the same config (a JAX run's dump must not carry the LLM sections it would then refuse)."""
    from orchestrator.config.schema import dump_config

    cfg = _load_shipped(path, tmp_path)
    assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg


def test_sections_reach_their_consumers_as_validated_objects():
    """One config path: the rooms get the section objects themselves, not field-by-field copies."""
    from ckpt_transfer.config import PublishConfig, WeightTransferConfig
    from rollout.config import EngineConfig, RolloutConfig
    from trainer.config import TrainerConfig
    from trainer.tiny_model import TinyModelConfig

    cfg = parse_config({**_base(), "rollout": {"kv_cache_gb": 0.5, "n_samples": 3}})
    assert isinstance(cfg.rollout, RolloutConfig) and isinstance(cfg.rollout, EngineConfig)
    assert isinstance(cfg.trainer, TrainerConfig) and isinstance(cfg.model.tiny, TinyModelConfig)
    assert isinstance(cfg.publish, PublishConfig) and isinstance(cfg.transfer, WeightTransferConfig)
    with pytest.raises(ConfigError, match=r"transfer.mooncake.bogus: unknown field"):
        parse_config({**_base(), "transfer": {"mooncake": {"bogus": 1}}})


def test_loss_options_resolve_to_the_loss_spec():
    t = parse_config({**_base(), "trainer": {"loss": "grpo", "clip_eps_low": 0.2, "clip_eps_high": 0.28,
                                             "loss_agg": "seq_mean_token_mean"}}).trainer
    spec = t.loss_spec()
    assert (spec.kind, spec.clip_eps_low, spec.clip_eps_high, spec.agg, spec.adv_std_norm) == (
        "grpo", 0.2, 0.28, "seq_mean_token_mean", True)
    spec = parse_config({**_base(), "trainer": {"loss": "grpo", "clip_eps": 0.3}}).trainer.loss_spec()
    assert (spec.clip_eps_low, spec.clip_eps_high) == (0.3, 0.3)
    assert parse_config({**_base(), "trainer": {"loss": "kimi"}}).trainer.loss_spec().adv_std_norm is False


@pytest.mark.parametrize("trainer, message", [
    ({"loss": "ppo_clip"}, "not PPO .*use loss: grpo with adv_std_norm: false"),
    ({"loss": "kimi", "loss_agg": "seq_mean_token_sum"}, "trainer.loss_agg applies to loss 'grpo' only"),
    ({"loss": "grpo", "clip_eps": 0.2, "clip_eps_high": 0.3}, "not both"),
    ({"lr_schedule": {"decay": "step"}}, "trainer.lr_schedule.decay"),
])
def test_bad_loss_options_are_refused_by_name(trainer, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**_base(), "trainer": trainer})


def test_sampling_fields_are_validated():
    with pytest.raises(ConfigError, match="rollout.top_p"):
        parse_config({**_base(), "rollout": {"top_p": 1.5}})
    with pytest.raises(ConfigError, match="rollout.top_k"):
        parse_config({**_base(), "rollout": {"top_k": -1}})


def test_a_gap_bound_the_dtype_cannot_reach_is_refused_at_load_time():
    """configs/quickstart.yaml's float32 bound of 1e-4 with model.dtype bfloat16 used to stop the run at iteration
    1, blaming the engines' weights; it is refused before anything starts, naming the dtype and its default."""
    shipped = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml").read_text())
    assert shipped["rollout"]["max_logprob_gap"] == 1e-4
    shipped["model"]["dtype"] = "bfloat16"
    with pytest.raises(ConfigError, match=r"rollout.max_logprob_gap 0.0001 is below what model.dtype bfloat16 "
                                          r"reaches.*bfloat16's default 0.03, or set at least 0.01"):
        parse_config(shipped)
    with pytest.raises(ConfigError, match="below what model.dtype float32 reaches"):
        parse_config({**_base(), "rollout": {"max_logprob_gap": 1e-7}})


def test_logprob_gap_bound_follows_the_model_dtype():
    cfg = parse_config(_base())
    assert cfg.rollout.logprob_gap_bound(cfg.model.dtype) == 1e-4
    bf16 = parse_config({**_base(), "model": {"dtype": "bfloat16"}})
    assert bf16.rollout.logprob_gap_bound("bfloat16") == 3e-2
    explicit = parse_config({**_base(), "model": {"dtype": "bfloat16"}, "rollout": {"max_logprob_gap": 0.01}})
    assert explicit.rollout.logprob_gap_bound("bfloat16") == 0.01
    assert "the default for model.dtype bfloat16" in bf16.rollout.logprob_gap_origin("bfloat16")
    assert "set in the config, model.dtype bfloat16" in explicit.rollout.logprob_gap_origin("bfloat16")
    with pytest.raises(ConfigError, match="no default rollout.max_logprob_gap for model.dtype 'float16'"):
        parse_config({**_base(), "model": {"dtype": "float16"}})
    assert parse_config({**_base(), "model": {"dtype": "float16"}, "rollout": {"max_logprob_gap": 0.05}})


def test_mismatch_correction_fields_are_validated():
    with pytest.raises(ConfigError, match="rollout.mismatch_correction"):
        parse_config({**_base(), "rollout": {"mismatch_correction": "is"}})
    with pytest.raises(ConfigError, match="rollout.tis_cap"):
        parse_config({**_base(), "rollout": {"tis_cap": 0.5}})
    with pytest.raises(ConfigError, match="rollout.mis_threshold"):
        parse_config({**_base(), "rollout": {"mismatch_correction": "mis", "mis_threshold": 1.0}})
    with pytest.raises(ConfigError, match=r"rollout.icepop_bounds \[2.0, 5.0\]: needs 0 < low < 1 < high"):
        parse_config({**_base(), "rollout": {"mismatch_correction": "icepop", "icepop_bounds": [2, 5]}})
    assert parse_config({**_base(), "rollout": {"mismatch_correction": "icepop", "icepop_bounds": [0.4, 3]}}
                        ).rollout.icepop_bounds == (0.4, 3.0)


def test_max_staleness_needs_a_correction_for_grpo():
    with pytest.raises(ConfigError, match="rollout.max_staleness 1 trains on samples of an older policy: set "
                                          "rollout.mismatch_correction"):
        parse_config({**_base(), "trainer": {"loss": "grpo"}, "rollout": {"max_staleness": 1}})
    for kimi in ("kimi", "kimi_token"):  # pi_old is the policy that sampled: the behaviour log-probs
        cfg = parse_config({**_base(), "trainer": {"loss": kimi}, "rollout": {"max_staleness": 1}})
        assert cfg.rollout.mismatch_correction == "none" and cfg.rollout.max_staleness == 1
    cfg = parse_config({**_base(), "rollout": {"max_staleness": 1, "mismatch_correction": "icepop"}})
    assert cfg.rollout.probe_interval == 0  # one engine: each batch is checked against the policy that sampled it


def test_loglinear_proximal_needs_a_stale_batch_tis_and_grpo():
    tis = {"max_staleness": 1, "mismatch_correction": "tis"}
    cfg = parse_config({**_base(), "trainer": {"loss": "grpo"}, "rollout": {**tis, "proximal": "loglinear"}})
    assert cfg.rollout.proximal == "loglinear"
    assert parse_config({**_base(), "rollout": tis}).rollout.proximal == "recompute"
    with pytest.raises(ConfigError, match="with max_staleness 0 every token is of the trainer.s own policy"):
        parse_config({**_base(), "rollout": {"mismatch_correction": "tis", "proximal": "loglinear"}})
    for other in ("mis", "icepop"):
        with pytest.raises(ConfigError, match=f"needs mismatch_correction tis .it is {other}"):
            parse_config({**_base(), "rollout": {**tis, "mismatch_correction": other, "proximal": "loglinear"}})
    with pytest.raises(ConfigError, match="loss kimi takes the policy that sampled as its pi_old"):
        parse_config({**_base(), "trainer": {"loss": "kimi"}, "rollout": {**tis, "proximal": "loglinear"}})


def test_partial_rollouts_and_a_bound_above_one_go_together():
    tis = {"mismatch_correction": "tis"}
    with pytest.raises(ConfigError, match="rollout.max_staleness 2: above 1 only with partial_rollout true"):
        parse_config({**_base(), "rollout": {"max_staleness": 2, **tis}})
    for bound in (0, 1):
        with pytest.raises(ConfigError, match=f"partial_rollout: needs max_staleness 2 or more .it is {bound}"):
            parse_config({**_base(), "rollout": {"max_staleness": bound, "partial_rollout": True, **tis}})
    with pytest.raises(ConfigError, match="partial_rollout with rollout.stop strings is not built"):
        parse_config({**_base(), "rollout": {"max_staleness": 2, "partial_rollout": True, "stop": ["\n"], **tis}})
    with pytest.raises(ConfigError, match="rollout.max_staleness 3 trains on samples of an older policy"):
        parse_config({**_base(), "trainer": {"loss": "grpo"}, "rollout": {"max_staleness": 3, "partial_rollout": True}})
    r = parse_config({**_base(), "rollout": {"max_staleness": 3, "partial_rollout": True, "max_new_tokens": 256,
                                             **tis}}).rollout
    assert r.segment_tokens == 86  # ceil(256 / 3): three samplings at most
    assert r.model_copy(update={"partial_rollout_tokens": 300}).segment_tokens == 256
    # the engines batch the new groups and those set aside in one call
    assert r.engine_config(10).max_num_seqs == max(256, r.prompts_per_iteration * r.n_samples * 3)


def test_weights_in_flight_are_refused_where_they_cannot_be_taken():
    tis = {"max_staleness": 1, "mismatch_correction": "tis", "weight_update": "in_flight"}
    r = parse_config({**_base(), "rollout": {**tis, "in_flight_step": 3}}).rollout
    assert (r.weight_update, r.in_flight_step) == ("in_flight", 3)
    with pytest.raises(ConfigError, match="needs max_staleness 1 .it is 0.: weights change during a batch drawn "
                                          "ahead only; sync_mode reload"):
        parse_config({**_base(), "rollout": {**tis, "max_staleness": 0, "in_flight_step": 3, "sync_mode": "restart"}})
    with pytest.raises(ConfigError, match="needs engine_process inline"):
        parse_config({**_base(), "rollout": {**tis, "in_flight_step": 3, "engine_process": "separate"}})
    with pytest.raises(ConfigError, match="in_flight with deterministic true needs rollout.in_flight_step"):
        parse_config({**_base(), "rollout": tis})
    assert parse_config({**_base(), "deterministic": False, "rollout": tis}).rollout.in_flight_step is None
    with pytest.raises(ConfigError, match="in_flight_step applies to weight_update in_flight only"):
        parse_config({**_base(), "rollout": {"in_flight_step": 3}})
    with pytest.raises(ConfigError, match="in_flight with `agent:` is not built"):
        parse_config({**_base(), "task": {"name": "guess"}, "agent": {"environment": "guess"},
                      "rollout": {**tis, "in_flight_step": 3}})


def test_placement_is_refused_where_it_cannot_be_made():
    cuda = {"trainer": {"device": "cuda", "backend": "nccl"}}
    with pytest.raises(ConfigError, match="placement.mode colocated: the engines share the trainer ranks' devices, "
                                          "but trainer.device is cuda and rollout.device cpu"):
        parse_config({**_base(), **cuda, "placement": {"mode": "colocated"}})
    both = {**cuda, "rollout": {"device": "cuda", "engines": 3}}
    with pytest.raises(ConfigError, match=r"3 engine\(s\) of rollout.tp 1 need 3 GPUs, the trainer's ranks hold 1"):
        parse_config({**_base(), **both, "placement": {"mode": "colocated"}})
    assert parse_config({**_base(), **cuda, "rollout": {"device": "cuda"},
                         "placement": {"mode": "colocated"}}).placement.mode == "colocated"
    with pytest.raises(ConfigError, match="placement.rollout_cpus splits CPU cores"):
        parse_config({**_base(), **cuda, "placement": {"mode": "disaggregated", "rollout_cpus": 1}})
    with pytest.raises(ConfigError, match="placement.rollout_cpus splits the cores of placement.mode disaggregated"):
        parse_config({**_base(), "placement": {"rollout_cpus": 1}})
    with pytest.raises(ConfigError, match="VLLM_CPU_OMP_THREADS_BIND and placement.mode disaggregated both"):
        parse_config({**_base(), "placement": {"mode": "disaggregated"},
                      "rollout": {"extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}})
    assert parse_config({**_base(), "placement": {"mode": "disaggregated", "rollout_cpus": 1}}).placement.mode


def test_a_trainer_spanning_nodes_needs_an_even_split_and_the_transfer_engine():
    pp2 = {"trainer": {"parallel": {"pp": 2}}}
    with pytest.raises(ConfigError, match=r"placement.trainer_nodes 2: .*set transfer.enabled true"):
        parse_config({**_base(), **pp2, "placement": {"trainer_nodes": 2}})
    with pytest.raises(ConfigError, match=r"placement.trainer_nodes 3: the trainer's 2 ranks .* do not split evenly"):
        parse_config({**_base(), **pp2, "placement": {"trainer_nodes": 3}, "transfer": {"enabled": True}})
    cfg = parse_config({**_base(), **pp2, "placement": {"trainer_nodes": 2}, "transfer": {"enabled": True}})
    assert cfg.placement.trainer_nodes == 2


@pytest.mark.parametrize("path", ["/some/missing/dir", "./missing", "missing/dir/deeper", "~/missing-tide-model"])
def test_missing_local_model_path_is_refused_by_name(path):
    """Never sent to the hub as a repo id: a path that looks local and does not exist names model.path."""
    with pytest.raises(ConfigError, match=r"model\.path: .*no such directory"):
        parse_config({**_base(), "model": {"path": path}})


def test_hub_ids_and_existing_directories_pass(tmp_path):
    for path in ["Qwen/Qwen2.5-0.5B-Instruct", "gpt2", str(tmp_path)]:
        assert parse_config({**_base(), "model": {"path": path}}).model.path == path


def test_cli_exits_2_on_missing_model_path(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**_base(), "model": {"path": "/some/missing/dir"}}))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(cfg),
                           "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "model.path" in proc.stderr and "/some/missing/dir" in proc.stderr


def test_length_penalty_beside_reward_functions_is_refused():
    with pytest.raises(ConfigError, match=r"add \{fn: length"):
        parse_config({**_base(), "trainer": {"length_penalty": 0.1}, "rewards": [{"fn": "exact"}]})
    cfg = parse_config({**_base(), "rewards": [{"fn": "exact"}, {"fn": "length", "weight": 0.1}]})
    assert not cfg.needs_sandbox()
    assert parse_config({**_base(), "rewards": [{"fn": "code"}]}).needs_sandbox()


def test_prompt_limits_are_validated():
    with pytest.raises(ConfigError, match="rollout.overlong_prompts"):
        parse_config({**_base(), "rollout": {"max_prompt_tokens": 8, "overlong_prompts": "drop"}})
    with pytest.raises(ConfigError, match="rollout.max_prompt_tokens"):
        parse_config({**_base(), "rollout": {"max_prompt_tokens": 0}})


def test_probe_runs_by_default_only_where_the_first_mini_batch_may_miss_an_engine():
    from orchestrator.iteration.logprob_check import probe_due
    from rollout.config import RolloutConfig

    assert RolloutConfig(engines=1).probe_interval == 0  # every sample comes from the one engine
    assert RolloutConfig(engines=2).probe_interval == 1
    assert RolloutConfig(engines=2, probe_every=0).probe_interval == 0
    assert RolloutConfig(engines=1, probe_every=5).probe_interval == 5
    assert [it for it in range(1, 12) if probe_due(5, it)] == [5, 10]
    assert not any(probe_due(0, it) for it in range(1, 12))


# --- did you mean, overrides, `tide config show`, docs/config.md, relative paths, --version ---------------------

def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.run.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config({**_base(), **data})
    return str(e.value)


def test_unknown_key_names_the_near_spelling_only():
    msg = _error({"rollout": {"n_sampels": 4}})
    assert "rollout.n_sampels: unknown field; did you mean rollout.n_samples?" in msg
    assert "engine_process" not in msg and "tide config show" in msg  # no list of every key; a pointer instead


@pytest.mark.parametrize("data, meant", [
    ({"lr": 5e-4}, "lr: unknown field; did you mean trainer.lr, jax.lr?"),  # a key of another section
    ({"trainer": {"temperature": 0.7}}, "did you mean rollout.temperature, eval.temperature?"),
    ({"learning_rate": 5e-4}, "learning_rate: unknown field; did you mean trainer.lr (TRL's learning_rate)?"),
    ({"rollout": {"num_generations": 4}}, "did you mean rollout.n_samples (TRL's num_generations)?"),
    ({"trainer": {"beta": 0.01}}, "did you mean trainer.kl.coef (TRL's beta)?"),
    ({"rollout": {"n": 4}}, "rollout.n: unknown field; did you mean rollout.n_samples (veRL's "
                            "actor_rollout_ref.rollout.n)?"),
    ({"data": {"train_batch_size": 64}}, "did you mean rollout.prompts_per_iteration (veRL's data.train_batch_size)?"),
    ({"trainer": {"ppo_epochs": 2}}, "did you mean trainer.epochs (veRL's actor_rollout_ref.actor.ppo_epochs)?"),
])
def test_unknown_key_names_the_tide_key(data, meant):
    assert meant in _error(data)


def test_other_names_point_at_real_tide_keys():
    """Every TRL/veRL row of docs/config.md names a key tide has."""
    from orchestrator.config.schema import TideConfig, sections
    from orchestrator.config.names import OTHER_NAMES

    keys = {f"{s}.{n}" if s else n for s, model in sections() for n in model.model_fields}
    assert TideConfig.model_fields  # sections() walks from TideConfig
    assert [o.tide for o in OTHER_NAMES if o.tide not in keys] == []


def test_trl_names_are_grpo_config_fields():
    trl = pytest.importorskip("trl")
    from dataclasses import fields

    from orchestrator.config.names import OTHER_NAMES

    names = {f.name for f in fields(trl.GRPOConfig)}
    assert [o.name for o in OTHER_NAMES if o.source == "TRL" and o.name not in names] == []


def test_overrides_set_typed_nested_and_indexed_keys(tmp_path):
    from orchestrator.config.schema import parse_overrides

    args = ["trainer.lr=5e-4", "iterations=3", "trainer.shuffle_minibatches=false", 'rollout.stop=["\\n", "##"]',
            "trainer.kl.coef=0.05", "rewards.0.weight=0.5", "task.config.scale=1E-3", "logging.wandb.tags=[a]"]
    overrides = parse_overrides(args)
    assert overrides["trainer.lr"] == 5e-4 and isinstance(overrides["trainer.lr"], float)  # YAML 1.1: a string
    assert overrides["task.config.scale"] == 1e-3 and isinstance(overrides["task.config.scale"], float)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({**_base(), "rewards": [{"fn": "exact"}, {"fn": "numeric"}]}))
    cfg = load_config(cfg_file, overrides)
    assert (cfg.trainer.lr, cfg.iterations, cfg.trainer.shuffle_minibatches) == (5e-4, 3, False)
    assert cfg.rollout.stop == ["\n", "##"] and cfg.trainer.kl.coef == 0.05
    assert [r.weight for r in cfg.rewards] == [0.5, 1.0]
    assert cfg.task.config == {"scale": 1e-3} and isinstance(cfg.task.config["scale"], float)
    assert cfg.logging.wandb.tags == ["a"]


@pytest.mark.parametrize("arg, message", [
    ("trainer.lr", "expected key.path=value"),
    ("=3", "expected key.path=value"),
    ("trainer..lr=3", "expected key.path=value"),
    ("iterations.x=3", "iterations is 2, not a mapping"),
    ("rewards.3.weight=1", "rewards is a list of 1 item(s)"),
    ("rewards.first.weight=1", "rewards is a list of 1 item(s): index it by number"),
    ("trainer.lr=[1", "not valid YAML"),
])
def test_bad_overrides_are_refused(tmp_path, arg, message):
    from orchestrator.config.schema import parse_overrides

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({**_base(), "rewards": [{"fn": "exact"}]}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(cfg_file, parse_overrides([arg]))


def test_cli_bad_override_exits_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_base()))
    proc = _cli("run", str(cfg), "iterations.x=3", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "iterations is 2, not a mapping" in proc.stderr, proc.stderr
    proc = _cli("config", "show", str(cfg), "trainer.lr")
    assert proc.returncode == 2 and "expected key.path=value" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


def test_run_hands_the_overridden_config_to_the_run(tmp_path, monkeypatch):
    """What `tide run` starts (and writes to RUN_DIR/config.yaml, `dump_config` of it) carries the overrides."""
    from typer.testing import CliRunner

    from orchestrator.run import api, cli
    from orchestrator.config.schema import dump_config

    started = []
    monkeypatch.setattr(api, "execute", lambda cfg, run, resume: started.append(cfg))
    result = CliRunner().invoke(cli.app, ["run", str(ROOT / "configs" / "quickstart.yaml"), "trainer.lr=5e-4",
                                          "rollout.n_samples=3", "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    written = yaml.safe_load(dump_config(started[0]))
    assert written["trainer"]["lr"] == 5e-4 and written["rollout"]["n_samples"] == 3


def test_config_show_prints_the_resolved_config(tmp_path):
    path = ROOT / "configs" / "chat_dataset.yaml"
    proc = _cli("config", "show", str(path), "trainer.lr=5e-4", "iterations=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    from orchestrator.config.schema import dump_config

    cfg = load_config(path, {"trainer.lr": 5e-4, "iterations": 3})
    assert proc.stdout == dump_config(cfg)
    shown = yaml.safe_load(proc.stdout)
    assert parse_config(shown) == cfg and shown["trainer"]["lr"] == 5e-4 and shown["iterations"] == 3
    assert shown["rollout"]["max_logprob_gap"] is None and "top_k" in shown["rollout"]  # every default written
    bad = _cli("config", "show", str(path), "rollout.n_sampels=3", cwd=tmp_path)
    assert bad.returncode == 2 and "did you mean rollout.n_samples?" in bad.stderr, bad.stderr


def test_docs_config_md_is_current():
    from orchestrator.config.reference import REGENERATE, reference_markdown

    assert (ROOT / "docs" / "config.md").read_text() == reference_markdown(), (
        f"docs/config.md is out of date with the config models: regenerate it with `{REGENERATE}`")


def test_reference_shows_types_defaults_and_descriptions():
    from orchestrator.config.schema import sections
    from orchestrator.config.reference import reference_markdown, type_text
    from rollout.config import RolloutConfig

    text = reference_markdown()
    for section, model in sections():
        for name, field in model.model_fields.items():
            assert field.description, f"{section}.{name} has no description"
    fields = RolloutConfig.model_fields
    assert type_text(fields["top_p"].annotation, fields["top_p"].metadata) == "0 < float <= 1"
    assert type_text(fields["kv_cache_gb"].annotation, fields["kv_cache_gb"].metadata) == "float > 0 | null"
    assert type_text(fields["enforce_eager"].annotation, []) == 'bool | "auto"'
    assert type_text(fields["cache_root"].annotation, fields["cache_root"].metadata) == "path | null"
    assert "### `trainer.kl`" in text and "## `rewards[]`" in text and "### `jax.sac`" in text
    assert '| `device` | `"cpu" \\| "cuda"` | `"cpu"` |' in text
    assert "| `num_iterations` | `trainer.epochs` |" in text and "| `data.train_batch_size` |" in text


def _project(tmp_path: Path) -> Path:
    """A config in tmp/proj/cfg with its data, template and model directory beside it."""
    cfg_dir = tmp_path / "proj" / "cfg"
    (cfg_dir / "data").mkdir(parents=True)
    (cfg_dir / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (cfg_dir / "chat.jinja").write_text("{{ messages }}")
    (cfg_dir / "model").mkdir()
    return cfg_dir


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    cfg_dir = _project(tmp_path)
    cfg_file = cfg_dir / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({**_base(), "run_dir": "../runs/t",
                                        "task": {"name": "jsonl", "path": "data/train.jsonl"},
                                        "model": {"path": "model", "chat_template": "./chat.jinja"}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _cli("config", "show", str(cfg_file), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["task"]["path"] == str(cfg_dir / "data" / "train.jsonl")
    assert shown["model"]["path"] == str(cfg_dir / "model")
    assert shown["model"]["chat_template"] == str(cfg_dir / "chat.jinja")
    assert shown["run_dir"] == str(tmp_path / "proj" / "runs" / "t")
    # RUN_DIR/config.yaml holds absolute paths: it loads back the same from any directory (`tide resume`)
    run_dir = elsewhere / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(proc.stdout)
    assert load_config(run_dir / "config.yaml") == load_config(cfg_file)


def test_hub_id_stays_a_hub_id_and_a_missing_path_is_named_absolute(tmp_path):
    cfg_dir = _project(tmp_path)
    cfg_file = cfg_dir / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({**_base(), "model": {"path": "Qwen/Qwen2.5-7B"},
                                        "task": {"name": "jsonl", "path": "data/missing.jsonl"}}))
    proc = _cli("config", "show", str(cfg_file), cwd=tmp_path)
    assert proc.returncode == 2
    assert (f"task.path: no such file '{cfg_dir / 'data' / 'missing.jsonl'}' (relative paths resolve against the "
            f"config file's directory {cfg_dir})") in proc.stderr, proc.stderr
    cfg = load_config(cfg_file, {"task.path": "data/train.jsonl"})
    assert cfg.model.path == "Qwen/Qwen2.5-7B"
    with pytest.raises(ConfigError, match=re.escape(f"model.path: no such directory '{cfg_dir / 'missing'}'")):
        load_config(cfg_file, {"task.path": "data/train.jsonl", "model.path": "./missing"})


def test_a_dict_config_resolves_against_the_working_directory(tmp_path, monkeypatch):
    cfg_dir = _project(tmp_path)
    monkeypatch.chdir(cfg_dir)
    cfg = parse_config({**_base(), "task": {"name": "jsonl", "path": "data/train.jsonl"}})
    assert cfg.task.path == str(cfg_dir / "data" / "train.jsonl")
    with pytest.raises(ConfigError, match=re.escape(f"against the working directory {cfg_dir}")):
        parse_config({**_base(), "task": {"name": "jsonl", "path": "nope.jsonl"}})


def test_version():
    from importlib.metadata import version

    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"tide {version('tide')}", proc.stderr


def test_eval_samples_the_runs_distribution_unless_told_otherwise():
    """eval's sampled pass@k used temperature 1 over the whole vocabulary whatever the run sampled from; each
    field it leaves unset is now the run's own."""
    from trainer.batch import TokenDistribution

    cfg = parse_config({**_base(), "rollout": {"temperature": 0.7, "top_p": 0.9, "top_k": 20}})
    assert cfg.eval.sampling(cfg.rollout) == TokenDistribution(temperature=0.7, top_p=0.9, top_k=20)
    told = parse_config({**_base(), "rollout": {"temperature": 0.7, "top_p": 0.9},
                         "eval": {"every": 1, "temperature": 1.0, "top_k": 5}})
    assert told.eval.sampling(told.rollout) == TokenDistribution(temperature=1.0, top_p=0.9, top_k=5)


@pytest.mark.parametrize("agent, extra, message", [
    ({}, {}, "either `tools`"),
    ({"tools": ["python"], "environment": "guess"}, {}, "not both"),
    ({"tools": ["calculator"]}, {}, "'calculator' is neither `python` nor"),
    ({"tools": ["python", "python"]}, {}, "listed twice"),
    ({"environment": "chess"}, {}, "agent.environment"),
    ({"tool_parser": "mistral", "tools": ["python"]}, {}, "'hermes'"),
    ({"environment": "guess"}, {"rewards": [{"fn": "exact_match"}]}, "scores its trajectories itself"),
    ({"environment": "guess", "max_turns": 0}, {}, "agent.max_turns"),
    ({"tools": ["python"]}, {"rollout": {"max_staleness": 2, "partial_rollout": True, "mismatch_correction": "tis"}},
     "rollout.partial_rollout with agent.tools python or agent.environment code_feedback is not built"),
])
def test_agent_section_is_validated(agent, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({**_base(), "task": {"name": "guess"}, "agent": agent, **extra})


def test_agent_tools_need_the_sandbox_only_for_python():
    assert parse_config({**_base(), "agent": {"tools": ["python"]}}).needs_sandbox()
    assert parse_config({**_base(), "task": {"name": "code"}, "agent": {"environment": "code_feedback"}}).needs_sandbox()
    assert not parse_config({**_base(), "agent": {"tools": ["configs.chat_rewards:f"]}}).needs_sandbox()
    assert not parse_config({**_base(), "task": {"name": "guess"}, "agent": {"environment": "guess"}}).needs_sandbox()
