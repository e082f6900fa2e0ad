"""Layout rules of the DeepSeek-V3 Megatron <-> HF conversion (multi-latent attention, dense first layers, shared
and routed experts, router expert bias), on random tensors: no Megatron process needed."""
from __future__ import annotations

from types import SimpleNamespace

import re

import pytest
import torch

from ckpt_transfer.convert import RankLayout, UnsupportedModelError, deepseek_v3
from ckpt_transfer.convert.common import HFTensor

HEADS, NOPE, ROPE, V, Q_LORA, KV_LORA = 4, 8, 4, 6, 12, 16


def _config(**kw) -> SimpleNamespace:
    base = dict(model_type="deepseek_v3", hidden_size=16, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=24, moe_intermediate_size=10,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
                q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                v_head_dim=V, vocab_size=32, tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
                rope_interleave=True, attention_bias=False, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base.update(kw)
    return SimpleNamespace(**base)


def _hf_state(cfg) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, qk = cfg.hidden_size, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, h), "model.norm.weight": r(h), "lm_head.weight": r(cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
               p + "self_attn.kv_a_proj_with_mqa.weight": r(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
               p + "self_attn.kv_a_layernorm.weight": r(cfg.kv_lora_rank),
               p + "self_attn.kv_b_proj.weight": r(HEADS * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
               p + "self_attn.o_proj.weight": r(h, HEADS * cfg.v_head_dim)}
        if cfg.q_lora_rank is None:
            sd[p + "self_attn.q_proj.weight"] = r(HEADS * qk, h)
        else:
            sd |= {p + "self_attn.q_a_proj.weight": r(cfg.q_lora_rank, h),
                   p + "self_attn.q_a_layernorm.weight": r(cfg.q_lora_rank),
                   p + "self_attn.q_b_proj.weight": r(HEADS * qk, cfg.q_lora_rank)}
        if i < cfg.first_k_dense_replace:
            f, mlps = cfg.intermediate_size, ["mlp."]
        else:
            f = cfg.moe_intermediate_size
            mlps = ["mlp.shared_experts."] + [f"mlp.experts.{e}." for e in range(cfg.n_routed_experts)]
            sd |= {p + "mlp.gate.weight": r(cfg.n_routed_experts, h), p + "mlp.gate.e_score_correction_bias":
                   r(cfg.n_routed_experts)}
        for m in mlps:
            sd |= {p + m + "gate_proj.weight": r(f, h), p + m + "up_proj.weight": r(f, h), p + m + "down_proj.weight": r(h, f)}
    # a multi-token-prediction layer, as DeepSeek-V3's checkpoint holds it: not part of the main model
    sd[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"] = r(h, 2 * h)
    return sd


def _megatron_names(cfg, layers: range, ep_size: int = 1) -> list[str]:
    """Local parameter names of a stage holding `layers` (renumbered from 0), as Megatron's local MLA spec
    names them."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    q = (["linear_q_proj.weight"] if cfg.q_lora_rank is None else
         ["linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight"])
    for local, i in enumerate(layers):
        p = f"decoder.layers.{local}."
        names += [p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"]
        names += [p + "self_attention." + n for n in q + ["linear_kv_down_proj.weight", "kv_layernorm.weight",
                                                          "linear_kv_up_proj.weight", "linear_proj.weight"]]
        if i < cfg.first_k_dense_replace:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        else:
            names += [p + "mlp.router.weight", p + "mlp.router.expert_bias", p + "mlp.shared_experts.linear_fc1.weight",
                      p + "mlp.shared_experts.linear_fc2.weight"]
            for j in range(cfg.n_routed_experts // ep_size):
                names += [p + f"mlp.experts.local_experts.{j}.linear_fc1.weight",
                          p + f"mlp.experts.local_experts.{j}.linear_fc2.weight"]
    return names


def _merge(stream: list[HFTensor]) -> dict[str, torch.Tensor]:
    """What the publish path does with the stream: TP shards concatenated on their tp_dim, whole tensors kept;
    a name written twice is an error."""
    shards: dict[str, dict[int, HFTensor]] = {}
    for t in stream:
        assert t.tp_rank not in shards.setdefault(t.name, {}), f"{t.name} written twice by TP rank {t.tp_rank}"
        shards[t.name][t.tp_rank] = t
    out = {}
    for name, parts in shards.items():
        first = parts[0]
        if first.tp_dim is None:
            assert len(parts) == 1, name
            out[name] = first.value()
        else:
            assert sorted(parts) == list(range(first.tp_size)), name
            out[name] = torch.cat([parts[r].value() for r in range(first.tp_size)], dim=first.tp_dim)
    return out


def _round_trip(cfg, hf: dict[str, torch.Tensor], tp: int = 1, pp: int = 1, ep: int = 1) -> dict[str, torch.Tensor]:
    """HF -> every rank's Megatron state -> the HF stream of every rank, merged."""
    per_stage = cfg.num_hidden_layers // pp
    stream: list[HFTensor] = []
    for pp_rank in range(pp):
        layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
        first, last = pp_rank == 0, pp_rank == pp - 1
        names = [n for n in _megatron_names(cfg, layers, ep) if n.startswith("decoder.layers.")
                 or (first and n.startswith("embedding.")) or (last and not n.startswith("embedding."))]
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                # with tp x ep ranks only, data parallelism is ep: dense weights come from the first ep rank
                layout = RankLayout(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, ep_rank=ep_rank,
                                    ep_size=ep, dp_rank=ep_rank, layer_map={k: i for k, i in enumerate(layers)})
                local = deepseek_v3.hf_to_megatron(hf.__getitem__, names, cfg, layout)
                assert sorted(local) == sorted(names)
                stream += deepseek_v3.megatron_to_hf(list(local.items()), cfg, layout)
    return _merge(stream)


def _main_model(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    return {k: v for k, v in hf.items() if not k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)],
                         ids=["tp1", "tp2", "pp2", "ep2", "tp2xpp2xep2"])
def test_round_trip_is_exact(tp, pp, ep):
    cfg = _config()
    hf = _hf_state(cfg)
    back = _round_trip(cfg, hf, tp, pp, ep)
    want = _main_model(hf, cfg)  # the multi-token-prediction layer is neither loaded nor published
    assert sorted(back) == sorted(want)
    for name, t in want.items():
        assert torch.equal(back[name], t), name


def test_round_trip_without_q_compression():
    cfg = _config(q_lora_rank=None)
    hf = _hf_state(cfg)
    back = _round_trip(cfg, hf, tp=2)
    assert "model.layers.0.self_attn.q_proj.weight" in back
    assert all(torch.equal(back[k], v) for k, v in _main_model(hf, cfg).items())


def test_megatron_tensors_sit_where_megatron_reads_them():
    """The placements the round trip cannot see (it would also pass with two mirrored mistakes): TP rank 1's
    up projection holds heads 2-3; the kv down projection is [latent; rope key]; EP rank 1's local expert 0 is
    global expert 2 with [gate; up] in linear_fc1; pipeline stage 1's layer 0 is global layer 2."""
    cfg = _config()
    hf = _hf_state(cfg)
    qk = NOPE + ROPE
    layout = RankLayout(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, ep_rank=1, ep_size=2, layer_map={0: 2, 1: 3})
    names = ["decoder.layers.0.self_attention.linear_q_up_proj.weight",
             "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
             "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
             "decoder.layers.0.mlp.router.expert_bias"]
    local = deepseek_v3.hf_to_megatron(hf.__getitem__, names, cfg, layout)
    q_b = hf["model.layers.2.self_attn.q_b_proj.weight"]
    assert torch.equal(local[names[0]], q_b[2 * qk:])
    kv_a = hf["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(local[names[1]], kv_a[(KV_LORA + ROPE) // 2:])  # TP rank 1's half, rope key last
    gate, up = (hf[f"model.layers.2.mlp.experts.2.{n}_proj.weight"] for n in ("gate", "up"))
    f = cfg.moe_intermediate_size
    assert torch.equal(local[names[2]], torch.cat([gate[f // 2:], up[f // 2:]]))
    assert torch.equal(local[names[3]], hf["model.layers.2.mlp.gate.e_score_correction_bias"])


def test_only_the_first_data_parallel_rank_writes_dense_weights():
    cfg = _config()
    hf = _hf_state(cfg)
    names = _megatron_names(cfg, range(4), ep_size=2)
    layout = RankLayout(ep_rank=1, ep_size=2, dp_rank=1)
    stream = list(deepseek_v3.megatron_to_hf(deepseek_v3.hf_to_megatron(hf.__getitem__, names, cfg, layout).items(),
                                             cfg, layout))
    assert stream and all(".mlp.experts." in t.name for t in stream)
    assert {int(t.name.split(".mlp.experts.")[1].split(".")[0]) for t in stream} == {2, 3}


def test_transformer_kwargs_describe_the_model():
    kw = deepseek_v3.megatron_transformer_kwargs(_config())
    assert kw["moe_layer_freq"] == [0, 1, 1, 1]
    assert (kw["ffn_hidden_size"], kw["moe_ffn_hidden_size"], kw["moe_shared_expert_intermediate_size"]) == (24, 10, 10)
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (2, 1)
    assert kw["moe_router_topk_scaling_factor"] == 2.5 and kw["moe_router_bias_update_rate"] == 0.0
    assert (kw["q_lora_rank"], kw["kv_lora_rank"], kw["qk_head_dim"], kw["qk_pos_emb_head_dim"], kw["v_head_dim"]) == \
        (Q_LORA, KV_LORA, NOPE, ROPE, V)
    assert kw["rope_type"] == "rope"
    # one group of all experts: no group limiting at all
    assert deepseek_v3.megatron_transformer_kwargs(_config(n_group=1, topk_group=1))["moe_router_num_groups"] is None


@pytest.mark.parametrize("field,value", [
    ("topk_method", "greedy"), ("scoring_func", "softmax"), ("norm_topk_prob", False), ("rope_interleave", False),
    ("attention_bias", True), ("moe_layer_freq", 2), ("topk_group", 2), ("hidden_act", "gelu"),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_refusals_name_the_field(field, value):
    cfg = _config(**{field: value}, **({"n_group": 4} if field == "topk_group" else {}))
    with pytest.raises(UnsupportedModelError, match=rf"config.json field [\w.]*{field}"):
        deepseek_v3.check_supported(cfg)


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def test_yarn_maps_to_megatrons_mla_yarn():
    """DeepSeek-V3's released rope (yarn) becomes Megatron's MLA yarn with the same factors; with mscale and
    mscale_all_dim not both set, transformers scales cos/sin by mscale(factor) and leaves the softmax alone, which
    Megatron computes from (mscale, mscale_all_dim) = (1, 0)."""
    kw = deepseek_v3.megatron_transformer_kwargs(_config(rope_parameters=YARN))
    assert {k: kw[k] for k in ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                               "beta_slow", "mscale", "mscale_all_dim")} == dict(
        rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=16, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    kw = deepseek_v3.megatron_transformer_kwargs(_config(rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": None}))
    assert (kw["mscale"], kw["mscale_all_dim"]) == (1.0, 0.0)
    assert deepseek_v3.megatron_transformer_kwargs(_config())["rope_type"] == "rope"


@pytest.mark.parametrize("change,named", [
    ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "rope_type = 'llama3'"),
    ({"attention_factor": 2.0}, "rope_parameters.attention_factor = 2.0"),
    ({"truncate": False}, "rope_parameters.truncate = False"),
    ({"mscale": None}, "rope_parameters.mscale = None"),
    ({"original_max_position_embeddings": None}, "rope_parameters.original_max_position_embeddings = None"),
])
def test_rope_scaling_refusals_name_the_field(change, named):
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        deepseek_v3.check_supported(_config(rope_parameters={**YARN, **change}))
