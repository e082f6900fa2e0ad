"""The config fields the engines (vLLM 0.32) need to compute what transformers computes: added where a config.json
lacks them, as hf_overrides and into published config.json files; and the fields vLLM computes otherwise refused by
name. tests/integration/test_saved_by_transformers.py serves directories saved by transformers on real engines."""
from __future__ import annotations

import json
import re

import pytest


def _deepseek(**kw):
    from transformers import DeepseekV3Config

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                first_k_dense_replace=1)
    return DeepseekV3Config(**{**base, **kw})


def _gpt_oss(**kw):
    from transformers import GptOssConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                max_position_embeddings=256)
    return GptOssConfig(**{**base, **kw})


YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64}


def test_deepseek_v3_gets_the_routing_transformers_hard_codes():
    from ckpt_transfer.convert.engine_config import complete_config_json, engine_overrides

    cfg = _deepseek()
    assert getattr(cfg, "topk_method", None) is None and getattr(cfg, "scoring_func", None) is None
    fields = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert engine_overrides(cfg) == fields
    assert complete_config_json({"model_type": "deepseek_v3"}, cfg) == {"model_type": "deepseek_v3", **fields}
    released = _deepseek(topk_method="noaux_tc", scoring_func="sigmoid")  # as DeepSeek's own config.json holds them
    assert engine_overrides(released) == {}


def test_gpt_oss_gets_yarn_betas_where_absent():
    """vLLM's gpt-oss reads beta_fast and beta_slow without a default; transformers takes 32 and 1. The override sets
    the whole rope dict (vLLM replaces a dict field); the config.json gains them in the dict it holds."""
    from ckpt_transfer.convert.engine_config import complete_config_json, engine_overrides

    cfg = _gpt_oss(rope_parameters=dict(YARN))
    assert engine_overrides(cfg) == {"rope_parameters": {**YARN, "beta_fast": 32.0, "beta_slow": 1.0}}
    released = {"model_type": "gpt_oss", "rope_theta": 150000.0, "rope_scaling": {k: v for k, v in YARN.items()
                                                                                if k != "rope_theta"}}
    assert complete_config_json(released, cfg)["rope_scaling"] == {**released["rope_scaling"], "beta_fast": 32.0,
                                                                   "beta_slow": 1.0}
    saved = {"model_type": "gpt_oss", "rope_parameters": dict(YARN)}
    assert complete_config_json(saved, cfg)["rope_parameters"] == {**YARN, "beta_fast": 32.0, "beta_slow": 1.0}
    assert engine_overrides(_gpt_oss()) == {}  # the class's default rope has them


def test_publish_writes_the_completed_config(tmp_path):
    """copy_aux_files: the source's config.json gains the fields, the source itself is untouched."""
    from ckpt_transfer.writer import copy_aux_files

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(), out.mkdir()
    _deepseek().save_pretrained(src)
    before = (src / "config.json").read_bytes()
    assert copy_aux_files(src, out) == ["config.json"]
    published = json.loads((out / "config.json").read_text())
    assert published == {**json.loads(before), "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert (src / "config.json").read_bytes() == before and not list(out.glob(".config.json*"))


@pytest.mark.parametrize("make,named", [
    (lambda: _deepseek(tie_word_embeddings=True), "tie_word_embeddings = True"),
    (lambda: _gpt_oss(tie_word_embeddings=True), "tie_word_embeddings = True"),
    (lambda: _deepseek(rope_parameters={**YARN, "mscale": 0.707}), "rope_parameters.mscale = 0.707"),
    (lambda: _gpt_oss(swiglu_limit=5.0), "swiglu_limit = 5.0"),
    (lambda: _gpt_oss(rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
     "rope_parameters.rope_type = 'default'"),
    (lambda: _gpt_oss(rope_parameters={**YARN, "attention_factor": 2.0}), "rope_parameters.attention_factor = 2.0"),
    (lambda: _gpt_oss(layer_types=["full_attention", "sliding_attention"]), "layer_types = ['full_attention', "),
    (lambda: _gpt_oss(layer_types=["full_attention"] * 2), "layer_types = ['full_attention', 'full_attention']"),
], ids=["deepseek-tied", "gpt_oss-tied", "deepseek-mscale", "gpt_oss-limit", "gpt_oss-plain-rope",
        "gpt_oss-attention-factor", "gpt_oss-full-first", "gpt_oss-windowless-layers"])
def test_what_vllm_computes_otherwise_is_refused_by_field(make, named):
    from ckpt_transfer.convert import UnsupportedModelError, check_supported, family

    cfg = make()
    family(cfg).check_supported(cfg)  # the trainer computes it
    with pytest.raises(UnsupportedModelError, match=f"config.json field {re.escape(named)}"):
        check_supported(cfg)


def test_qwen2_head_dim_other_than_hidden_over_heads_is_refused():
    from transformers import Qwen2Config

    from ckpt_transfer.convert import UnsupportedModelError, check_supported

    sizes = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    check_supported(Qwen2Config(**sizes, head_dim=32))
    with pytest.raises(UnsupportedModelError, match="config.json field head_dim = 16"):
        check_supported(Qwen2Config(**sizes, head_dim=16))


def test_windowless_gpt_oss_and_neutral_fields_pass():
    from ckpt_transfer.convert import check_supported

    check_supported(_gpt_oss(sliding_window=None, layer_types=["full_attention"] * 2))
    check_supported(_deepseek(rope_parameters={**YARN, "mscale": 1.0}))
    check_supported(_deepseek(rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}))
