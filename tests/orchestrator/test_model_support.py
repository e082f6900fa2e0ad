"""A model whose config.json asks for computation the trainer does not implement stops `tide run` before anything
starts (a ConfigError naming the field, `tide run`'s exit 2; no run directory left); a Llama 3.x directory with
llama3 rope scaling starts."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="llama3", hidden_size=64, num_heads=2, num_kv_heads=1)
    return build_tiny_model(tmp_path_factory.mktemp("llama3") / "model", AdditionTask(1).corpus(), spec)


def _edited_copy(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _config(tmp_path: Path, model_dir: Path) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "m", "iterations": 1, "model": {"path": str(model_dir)},
                                   "task": {"name": "addition", "max_digits": 1},
                                   "rollout": {"max_new_tokens": 4, "max_prompt_tokens": 64}}))
    return cfg


def _run(tmp_path: Path, model_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`tide run` in its own process."""
    return subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(_config(tmp_path, model_dir)),
                           "--run-dir", str(tmp_path / "run"), *overrides], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def _refused(tmp_path: Path, model_dir: Path, *overrides: str) -> str:
    """What `tide run` does, in this process (orchestrator.run.api): the message of the ConfigError the CLI exits 2
    with (test_the_cli_exits_2_naming_the_field: its own process), after checking that no run directory is left.
    A run that is not refused fails where it would start Ray."""
    from orchestrator.config.schema import ConfigError
    from orchestrator.run import api

    def not_refused(*args, **kwargs):
        raise AssertionError("the run was not refused: it went on to start Ray")

    with pytest.MonkeyPatch.context() as patch, pytest.raises(ConfigError) as e:
        patch.setattr("orchestrator.iteration.session.connect", not_refused)
        api.run(_config(tmp_path, model_dir), overrides, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    return " ".join(str(e.value).split())


def test_released_llama3_config_is_read_with_its_rope_scaling(llama3_dir):
    from transformers import AutoConfig

    from ckpt_transfer.convert import check_supported

    raw = json.loads((llama3_dir / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in raw  # as Meta ships it
    check_supported(AutoConfig.from_pretrained(llama3_dir))


@pytest.mark.parametrize("fields,named", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     "config.json field rope_scaling.rope_type = 'yarn'"),
    ({"hidden_act": "gelu"}, "config.json field hidden_act = 'gelu'"),
    ({"model_type": "gemma2"}, None),  # transformers reads it as another architecture: refused by model_type
    # the trainer computes it, vLLM's Qwen2 does not (it takes hidden_size / num_attention_heads, 32 here)
    ({"model_type": "qwen2", "head_dim": 16}, "config.json field head_dim = 16"),
], ids=["yarn", "gelu", "gemma2", "engine-qwen2-head-dim"])
def test_unsupported_model_is_refused_naming_the_field(tmp_path, llama3_dir, fields, named):
    model = _edited_copy(llama3_dir, tmp_path / "model", **fields)
    assert (named or "model_type") in _refused(tmp_path, model)


def test_the_cli_exits_2_naming_the_field(tmp_path, llama3_dir):
    """The refusal through `tide run`: exit 2, its one-line reason, no traceback, no run directory."""
    model = _edited_copy(llama3_dir, tmp_path / "model", hidden_act="gelu")
    proc = _run(tmp_path, model)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config.json field hidden_act = 'gelu'" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_lora_on_stacked_experts_is_refused_naming_the_targets(tmp_path):
    """gpt_oss's checkpoint stacks each layer's experts in one tensor: LoRA's default targets (the MLP projections
    among them) are refused at start-up, naming them and what can be adapted, before any rank starts."""
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="gpt_oss", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_experts=4)
    model = build_tiny_model(tmp_path / "gpt_oss", AdditionTask(1).corpus(), spec)
    why = _refused(tmp_path, model, "trainer.lora={rank: 4, alpha: 8, sync: merged}", "rollout.sync_mode=restart")
    assert ("trainer.lora.target_modules ['down_proj', 'gate_proj', 'up_proj']: LoRA on gpt_oss's experts is not "
            "implemented") in why, why


def test_routing_replay_on_a_dense_model_is_refused(tmp_path, llama3_dir):
    why = _refused(tmp_path, llama3_dir, "trainer.moe.routing_replay=rollout")
    assert "trainer.moe.routing_replay: rollout needs a mixture-of-experts model" in why, why


def test_routing_replay_on_engines_told_not_to_record_is_refused(tmp_path):
    """Replay needs the rollout's routing: engines told not to record it are refused at start-up, not found out at
    the first train step."""
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=32)
    model = build_tiny_model(tmp_path / "moe", AdditionTask(1).corpus(), spec)
    why = _refused(tmp_path, model, "trainer.moe.routing_replay=rollout", "rollout.sync_mode=restart",
                   "rollout.record_routing=false")
    assert "needs the engines to record the experts they route to" in why, why


def _config_dir(tmp_path: Path, **fields) -> Path:
    """A model directory holding only a config.json (all that the support check reads): a small Llama with
    `fields` written over it as a released file would hold them."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64).save_pretrained(tmp_path)
    raw = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items() if k != "rope_parameters"}
    (tmp_path / "config.json").write_text(json.dumps({**raw, **fields}))
    return tmp_path


@pytest.mark.parametrize("fields,named", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "rope_theta": 1e4}}, "rope_parameters.rope_type = 'yarn'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
      "rope_theta": 1e4}, "rope_scaling.rope_type = 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type = 'dynamic'"),
], ids=["rope_parameters", "rope_scaling", "rope_scaling-type"])
def test_rope_field_is_named_as_the_file_names_it(tmp_path, fields, named):
    """transformers 5 reads `rope_scaling` and `rope_parameters` into one attribute (each the other's alias): the
    refusal names the field the user will find in the file."""
    from transformers import AutoConfig

    from ckpt_transfer.convert import UnsupportedModelError, check_supported

    with pytest.raises(UnsupportedModelError) as e:
        check_supported(AutoConfig.from_pretrained(_config_dir(tmp_path, **fields)))
    assert str(e.value) == f"config.json field {named}: this rope type is not implemented for llama (supported: " \
                           f"default, linear, llama3)"


def test_every_unsupported_field_is_listed_at_once(tmp_path):
    """Three refused fields: one message naming the three (the run exits 2 with it: ConfigError), not the first
    of three runs."""
    from orchestrator.config.schema import ConfigError, parse_config
    from orchestrator.iteration.session import _check_model_supported

    model = _config_dir(tmp_path, hidden_act="gelu", mlp_bias=True,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    cfg = parse_config({"name": "m", "iterations": 1, "model": {"path": str(model)}})
    with pytest.raises(ConfigError) as e:
        _check_model_supported(str(model), cfg)
    lines = str(e.value).splitlines()
    assert lines[0] == f"model {model}: 3 fields of the model's config.json ask for computation tide does not " \
                       f"implement:"
    assert [line.split(" = ")[0] for line in lines[1:]] == [
        "  config.json field rope_scaling.rope_type", "  config.json field hidden_act",
        "  config.json field mlp_bias"]
