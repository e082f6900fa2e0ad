"""The YAML schema: bad input is reported by field name, with what is allowed, and exit code 2."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def _base():
    return {"name": "t", "iterations": 2}


def test_shipped_configs_validate():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


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
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(cfg), "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "trainer.lr" in proc.stderr and "greater than 0" in proc.stderr
    assert not (tmp_path / "r").exists()


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
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(cfg), "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "does not use the section(s) rollout" in proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_resolved_config_loads_back_unchanged(path):
    """`tide resume` reads the run directory's config.yaml: the dump of every shipped config must parse back
    to the same config (a JAX run's dump must not carry the LLM sections it would then refuse)."""
    from orchestrator.config import dump_config

    cfg = load_config(path)
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


def test_logprob_gap_bound_follows_the_model_dtype():
    cfg = parse_config(_base())
    assert cfg.rollout.logprob_gap_bound(cfg.model.dtype) == 1e-4
    bf16 = parse_config({**_base(), "model": {"dtype": "bfloat16"}})
    assert bf16.rollout.logprob_gap_bound("bfloat16") == 3e-2
    explicit = parse_config({**_base(), "model": {"dtype": "bfloat16"}, "rollout": {"max_logprob_gap": 0.01}})
    assert explicit.rollout.logprob_gap_bound("bfloat16") == 0.01
    with pytest.raises(ConfigError, match="no default rollout.max_logprob_gap for model.dtype 'float16'"):
        parse_config({**_base(), "model": {"dtype": "float16"}})
    assert parse_config({**_base(), "model": {"dtype": "float16"}, "rollout": {"max_logprob_gap": 0.05}})


def test_mismatch_correction_fields_are_validated():
    with pytest.raises(ConfigError, match="rollout.mismatch_correction"):
        parse_config({**_base(), "rollout": {"mismatch_correction": "is"}})
    with pytest.raises(ConfigError, match="rollout.tis_cap"):
        parse_config({**_base(), "rollout": {"tis_cap": 0.5}})


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
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(cfg), "--run-dir", str(tmp_path / "r")],
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
    from orchestrator.logprob_check import probe_due
    from rollout.config import RolloutConfig

    assert RolloutConfig(engines=1).probe_interval == 0  # every sample comes from the one engine
    assert RolloutConfig(engines=2).probe_interval == 1
    assert RolloutConfig(engines=2, probe_every=0).probe_interval == 0
    assert RolloutConfig(engines=1, probe_every=5).probe_interval == 5
    assert [it for it in range(1, 12) if probe_due(5, it)] == [5, 10]
    assert not any(probe_due(0, it) for it in range(1, 12))
