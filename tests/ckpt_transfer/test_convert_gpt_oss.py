"""gpt_oss conversion rules on random tensors (no Megatron process): stacked, column-interleaved experts, sinks,
biases; the TransformerConfig fields that reproduce its attention and activation; what is refused by name.
Megatron's logits against transformers' and vLLM's log-probs: tests/integration/test_publish_layouts.py."""
from __future__ import annotations

import math
import re

import pytest
import torch
from ckpt_helpers import merge_published


def _config(**kw):
    from transformers import GptOssConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False})
    base.update(kw)
    return GptOssConfig(**base)


def _hf_state(cfg) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    h, w, e, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h), "model.norm.weight": torch.randn(h),
          "lm_head.weight": torch.randn(cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                  "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
                  "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
                  "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
                  "self_attn.o_proj.weight": (h, q), "self_attn.o_proj.bias": (h,),
                  "self_attn.sinks": (cfg.num_attention_heads,),
                  "mlp.router.weight": (e, h), "mlp.router.bias": (e,),
                  "mlp.experts.gate_up_proj": (e, h, 2 * w), "mlp.experts.gate_up_proj_bias": (e, 2 * w),
                  "mlp.experts.down_proj": (e, w, h), "mlp.experts.down_proj_bias": (e, h)}
        sd.update({p + n: torch.randn(*s) for n, s in shapes.items()})
    return sd


def _megatron_names(cfg) -> list[str]:
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"decoder.layers.{i}."
        names += [p + n for n in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
            "self_attention.core_attention.softmax_offset", "pre_mlp_layernorm.weight", "mlp.router.weight",
            "mlp.router.bias")]
        names += [p + f"mlp.experts.local_experts.{e}.{fc}.{kind}" for e in range(cfg.num_local_experts)
                  for fc in ("linear_fc1", "linear_fc2") for kind in ("weight", "bias")]
    return names


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_hf_megatron_hf(tp, ep):
    """Every tensor goes HF -> Megatron -> HF exactly. Under TP the sinks are per-head shards; experts stay whole
    on every TP rank (expert tensor parallelism 1) and are written once, by the first rank of their data-parallel
    group; o_proj's and the router's biases are replicated. Expert-parallel rank r holds experts r * E / ep on as
    its local 0, 1, ... and publishes its block of each stacked expert tensor as shard r of ep along dim 0."""
    from ckpt_transfer.convert import RankLayout, family

    cfg = _config()
    hf = _hf_state(cfg)
    conv = family(cfg)
    local_experts = cfg.num_local_experts // ep
    names = [n for n in _megatron_names(cfg) if ".local_experts." not in n or
             int(n.split(".local_experts.")[1].split(".")[0]) < local_experts]
    shards: dict[str, list] = {}
    for e in range(ep):
        for r in range(tp):
            # dense tensors written by expert-parallel rank 0's TP ranks; experts by each block's first TP rank
            layout = RankLayout(tp_rank=r, tp_size=tp, ep_rank=e, ep_size=ep, dp_rank=e, expert_dp_rank=r)
            local = conv.hf_to_megatron(hf.__getitem__, names, cfg, layout)
            assert set(local) == set(names)
            sinks = local["decoder.layers.1.self_attention.core_attention.softmax_offset"]
            assert torch.equal(sinks, hf["model.layers.1.self_attn.sinks"].chunk(tp)[r])
            down = local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
            assert torch.equal(down, hf["model.layers.0.mlp.experts.down_proj"][e * local_experts].T)
            for t in conv.megatron_to_hf(local.items(), cfg, layout):
                shards.setdefault(t.name, []).append(t)
    assert set(shards) == set(hf)
    for name, parts in shards.items():
        merged, indices = merge_published(parts)
        want = ep if ".mlp.experts." in name else 1 if parts[0].tp_dim is None else tp
        assert indices == list(range(want)), name
        assert torch.equal(merged, hf[name]), name


def test_expert_layout_by_hand():
    """Expert e's linear_fc1 is [gate; up] as rows: transformers' gate is gate_up_proj[e][:, ::2] (x @ W), up the
    odd columns; linear_fc2 is down_proj[e] transposed."""
    from ckpt_transfer.convert import RankLayout, family

    cfg = _config()
    hf = _hf_state(cfg)
    p = "decoder.layers.0.mlp.experts.local_experts.2."
    local = family(cfg).hf_to_megatron(hf.__getitem__, [p + "linear_fc1.weight", p + "linear_fc1.bias",
                                                        p + "linear_fc2.weight", p + "linear_fc2.bias"], cfg,
                                       RankLayout())
    gate_up = hf["model.layers.0.mlp.experts.gate_up_proj"][2]
    bias = hf["model.layers.0.mlp.experts.gate_up_proj_bias"][2]
    w = cfg.intermediate_size
    fc1 = local[p + "linear_fc1.weight"]
    assert fc1.shape == (2 * w, cfg.hidden_size)
    for j in (0, 5, w - 1):
        assert torch.equal(fc1[j], gate_up[:, 2 * j]) and torch.equal(fc1[w + j], gate_up[:, 2 * j + 1])
        assert local[p + "linear_fc1.bias"][j] == bias[2 * j] and local[p + "linear_fc1.bias"][w + j] == bias[2 * j + 1]
    assert torch.equal(local[p + "linear_fc2.weight"], hf["model.layers.0.mlp.experts.down_proj"][2].T)
    assert torch.equal(local[p + "linear_fc2.bias"], hf["model.layers.0.mlp.experts.down_proj_bias"][2])


def test_transformer_config_fields():
    """The attention and activation as Megatron fields: transformers' window of W keys is (W - 1, 0); sliding
    layers as listed in layer_types; yarn's attention factor (0.1 ln(factor) + 1, factor 4 here) squared in the
    softmax scale; top-k then softmax; gate * sigmoid(1.702 gate) * (up + 1) with both clamped at swiglu_limit."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from ckpt_transfer.convert import family

    cfg = _config()
    kw = family(cfg).megatron_transformer_kwargs(cfg)
    assert kw["window_size"] == (3, 0) and kw["window_attn_skip_freq"] == [1, 0]
    assert kw["softmax_scale"] == pytest.approx((0.1 * math.log(4.0) + 1) ** 2 / math.sqrt(8), rel=1e-12)
    assert kw["softmax_type"] == "learnable" and kw["add_qkv_bias"] and kw["add_bias_linear"]
    assert kw["activation_func"] is quick_gelu and kw["glu_linear_offset"] == 1.0
    assert kw["activation_func_clamp_value"] == 7.0 and kw["moe_router_pre_softmax"] is False
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 16
    plain = family(cfg).megatron_transformer_kwargs(_config(rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0},
                                                            layer_types=["full_attention"] * 2))
    assert plain["softmax_scale"] == pytest.approx(1 / math.sqrt(8), rel=1e-12) and "window_size" not in plain


@pytest.mark.parametrize("fields,named", [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha = 1.5"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types = ['chunked_attention']"),
    ({"sliding_window": None}, "sliding_window = None"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config.quant_method = 'mxfp4'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 150000.0}},
     "rope_parameters.rope_type = 'dynamic'"),  # named as the config gives it, not by transformers' alias
    ({"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1"),
], ids=["alpha", "layer-type", "no-window", "mxfp4", "dynamic-rope", "router-noise"])
def test_unsupported_computation_is_refused_by_field(fields, named):
    from ckpt_transfer.convert import UnsupportedModelError, check_supported

    check_supported(_config())
    cfg = _config()
    for k, v in fields.items():
        setattr(cfg, k, v)
    with pytest.raises(UnsupportedModelError, match=f"config.json field {re.escape(named)}"):
        check_supported(cfg)

