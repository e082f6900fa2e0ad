"""Layout rules of the dense Megatron <-> HF conversion, on random tensors (no Megatron process needed)."""
import re

import pytest
import torch
from types import SimpleNamespace

from ckpt_transfer.convert import AttentionShape, ConversionError, RankLayout, fuse_qkv, split_qkv, tp_slice
from ckpt_transfer.convert import dense
from ckpt_helpers import merge_published


def _hf_config(**kw):
    base = dict(model_type="qwen2", hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=4,
                intermediate_size=24, num_hidden_layers=2, vocab_size=64, tie_word_embeddings=False,
                rms_norm_eps=1e-6, hidden_act="silu")
    base.update(kw)
    return SimpleNamespace(**base)


def _hf_state(cfg, bias=True):
    torch.manual_seed(0)
    att = AttentionShape.from_hf(cfg)
    h, f = cfg.hidden_size, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h), "model.norm.weight": torch.randn(h),
          "lm_head.weight": torch.randn(cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.randn(h)
        sd[p + "post_attention_layernorm.weight"] = torch.randn(h)
        sd[p + "self_attn.q_proj.weight"] = torch.randn(att.num_heads * att.head_dim, h)
        sd[p + "self_attn.k_proj.weight"] = torch.randn(att.num_kv_heads * att.head_dim, h)
        sd[p + "self_attn.v_proj.weight"] = torch.randn(att.num_kv_heads * att.head_dim, h)
        if bias:
            for n in ("q", "k", "v"):
                sd[p + f"self_attn.{n}_proj.bias"] = torch.randn(sd[p + f"self_attn.{n}_proj.weight"].shape[0])
        sd[p + "self_attn.o_proj.weight"] = torch.randn(h, att.num_heads * att.head_dim)
        sd[p + "mlp.gate_proj.weight"] = torch.randn(f, h)
        sd[p + "mlp.up_proj.weight"] = torch.randn(f, h)
        sd[p + "mlp.down_proj.weight"] = torch.randn(h, f)
    return sd


def _megatron_names(cfg, layers, bias=True):
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                  "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                                  "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
        if bias:
            names.append(p + "self_attention.linear_qkv.bias")
    return names


def test_qkv_interleaving_with_grouped_query_attention():
    att = AttentionShape(num_heads=8, num_kv_heads=2, head_dim=3, hidden_size=5)
    # Label every row with (group, slot) so the Megatron order is visible.
    q = torch.arange(8 * 3).float()[:, None].expand(-1, 5)
    k = 100 + torch.arange(2 * 3).float()[:, None].expand(-1, 5)
    v = 200 + torch.arange(2 * 3).float()[:, None].expand(-1, 5)
    fused = fuse_qkv(q, k, v, att, tp_size=1)
    # group 0: q heads 0-3 (rows 0..11), k head 0 (100..102), v head 0 (200..202); then group 1
    assert fused[:12, 0].tolist() == list(range(12))
    assert fused[12:15, 0].tolist() == [100, 101, 102]
    assert fused[15:18, 0].tolist() == [200, 201, 202]
    assert fused[18, 0].item() == 12
    q2, k2, v2 = split_qkv(fused, att, tp_size=1)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_hf_megatron_hf(tp, tied):
    cfg = _hf_config(tie_word_embeddings=tied)
    hf = _hf_state(cfg)
    if tied:
        del hf["lm_head.weight"]
    names = [n for n in _megatron_names(cfg, 2) if not (tied and n == "output_layer.weight")]
    shards: dict[str, list] = {}
    for r in range(tp):
        layout = RankLayout(tp_rank=r, tp_size=tp)
        local = dense.hf_to_megatron(hf.__getitem__, names, cfg, layout)
        for t in dense.megatron_to_hf(local.items(), cfg, layout):
            shards.setdefault(t.name, []).append(t)
    assert set(shards) == set(hf)
    for name, parts in shards.items():
        if parts[0].tp_dim is None:
            assert len(parts) == 1, f"{name} replicated but written by {len(parts)} ranks"
        merged, _ = merge_published(parts)
        assert torch.equal(merged, hf[name]), name


def test_pipeline_stage_layers_are_renumbered_globally():
    cfg = _hf_config(num_hidden_layers=4)
    hf = _hf_state(cfg)
    layout = RankLayout(pp_rank=1, pp_size=2, layer_map={0: 2, 1: 3})
    names = [n for n in _megatron_names(cfg, 2) if n.startswith("decoder.layers.")]
    local = dense.hf_to_megatron(hf.__getitem__, names, cfg, layout)
    out = {t.name: t.value() for t in dense.megatron_to_hf(local.items(), cfg, layout)}
    assert {n.split(".")[2] for n in out} == {"2", "3"}
    assert torch.equal(out["model.layers.3.mlp.down_proj.weight"], hf["model.layers.3.mlp.down_proj.weight"])


def test_unknown_parameter_is_named():
    with pytest.raises(ConversionError, match="decoder.layers.0.mystery.weight"):
        list(dense.megatron_to_hf([("decoder.layers.0.mystery.weight", torch.zeros(1))], _hf_config(), RankLayout()))


def test_tp_slice_refuses_indivisible():
    with pytest.raises(ConversionError, match="not divisible"):
        tp_slice(torch.zeros(5, 2), 0, 0, 2)


def _qwen3_moe_config(**kw):
    return _hf_config(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **kw)


def _qwen3_moe_state(cfg):
    """Qwen3-MoE in HF's per-expert checkpoint layout: q/k norms, `mlp.gate` router, `mlp.experts.{e}.*`."""
    sd = {k: v for k, v in _hf_state(cfg, bias=False).items() if ".mlp." not in k}
    h, f, d = cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_norm.weight"] = torch.randn(d)
        sd[p + "self_attn.k_norm.weight"] = torch.randn(d)
        sd[p + "mlp.gate.weight"] = torch.randn(cfg.num_experts, h)
        for e in range(cfg.num_experts):
            sd[p + f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(f, h)
            sd[p + f"mlp.experts.{e}.up_proj.weight"] = torch.randn(f, h)
            sd[p + f"mlp.experts.{e}.down_proj.weight"] = torch.randn(h, f)
    return sd


def _qwen3_moe_names(cfg, local_experts):
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"decoder.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                  "self_attention.linear_proj.weight", "self_attention.q_layernorm.weight",
                                  "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight",
                                  "mlp.router.weight")]
        names += [p + f"mlp.experts.local_experts.{j}.{fc}.weight" for j in range(local_experts)
                  for fc in ("linear_fc1", "linear_fc2")]
    return names


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_qwen3_moe_round_trip_in_every_layout(tp, ep):
    """Qwen3-MoE: q/k norms, router and experts go HF -> Megatron -> HF exactly; under expert parallelism each rank
    holds E/ep experts and publishes them under their global index."""
    from ckpt_transfer.convert import family

    cfg = _qwen3_moe_config()
    hf = _qwen3_moe_state(cfg)
    conv = family(cfg)
    names = _qwen3_moe_names(cfg, cfg.num_experts // ep)
    shards: dict[str, list] = {}
    for e in range(ep):
        for r in range(tp):
            layout = RankLayout(tp_rank=r, tp_size=tp, ep_rank=e, ep_size=ep, dp_rank=e)  # dense written by ep rank 0
            local = conv.hf_to_megatron(hf.__getitem__, names, cfg, layout)
            if e == 1:  # expert-parallel rank 1 holds experts 2 and 3 as its local 0 and 1
                want = hf["model.layers.0.mlp.experts.2.down_proj.weight"]
                got = local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
                assert torch.equal(got, tp_slice(want, 1, r, tp))
            for t in conv.megatron_to_hf(local.items(), cfg, layout):
                shards.setdefault(t.name, []).append(t)
    assert set(shards) == set(hf)
    for name, parts in shards.items():
        merged, _ = merge_published(parts)
        assert len(parts) == (1 if parts[0].tp_dim is None else tp), name
        assert torch.equal(merged, hf[name]), name


def test_router_normalisation_follows_norm_topk_prob():
    """Megatron's top-k-then-softmax equals softmax, top-k, renormalise (norm_topk_prob true, Mixtral); without
    renormalisation the probabilities come from a softmax over all experts (pre_softmax)."""
    from ckpt_transfer.convert import family

    assert family(_qwen3_moe_config()).megatron_transformer_kwargs(_qwen3_moe_config())["moe_router_pre_softmax"] is False
    plain = _qwen3_moe_config()
    plain.norm_topk_prob = False
    kw = family(plain).megatron_transformer_kwargs(plain)
    assert kw["moe_router_pre_softmax"] is True and kw["qk_layernorm"] is True and kw["moe_ffn_hidden_size"] == 12


@pytest.mark.parametrize("field,value,named", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_parameters.rope_type = 'yarn'"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type = 'dynamic'"),
    ("use_sliding_window", True, "sliding_window = 4096"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping = 30.0"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping = 50.0"),
    ("hidden_act", "gelu_pytorch_tanh", "hidden_act = 'gelu_pytorch_tanh'"),
    ("attention_bias", True, "attention_bias = True"),
    ("mlp_bias", True, "mlp_bias = True"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor = 0.5"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config.quant_method = 'fp8'"),
    ("model_type", "gemma3_text", "model_type = 'gemma3_text'"),
])
def test_unsupported_computation_is_refused_by_field(field, value, named):
    from ckpt_transfer.convert import UnsupportedModelError, check_supported

    cfg = _hf_config(model_type="llama", sliding_window=4096, rope_parameters=None)
    check_supported(cfg)  # the neutral config passes: a sliding window that is not used is no computation
    if field == "rope_scaling":
        cfg.rope_parameters = None
    setattr(cfg, field, value)
    with pytest.raises(UnsupportedModelError, match=f"config.json field {re.escape(named)}"):
        check_supported(cfg)


def test_moe_layout_refusals_name_the_field():
    from ckpt_transfer.convert import UnsupportedModelError, check_supported

    for field, value in (("decoder_sparse_step", 2), ("mlp_only_layers", [0])):
        cfg = _qwen3_moe_config()
        setattr(cfg, field, value)
        with pytest.raises(UnsupportedModelError, match=f"config.json field {field} = "):
            check_supported(cfg)
    cfg = _hf_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1)
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise = 0.1"):
        check_supported(cfg)


def test_llama3_rope_frequencies_are_transformers_own():
    """The trainer's rotary frequencies for a llama3-scaled rope are the ones transformers computes (and differ
    from plain rope: a trainer ignoring rope_scaling would rotate by other angles)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainer.megatron.model import rope_inv_freq, rope_theta

    rope = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_theta=500000.0, rope_scaling=rope)
    got = rope_inv_freq(cfg)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 32, 2).float() / 32)
    assert rope_theta(cfg) == 500000.0
    assert torch.equal(got, want.float())
    assert not torch.allclose(got, plain) and torch.equal(got[:2], plain[:2])  # wavelengths under 64/4 untouched
    assert rope_inv_freq(LlamaConfig(hidden_size=64, num_attention_heads=2)) is None


def test_replicas_split_what_they_hold_alike_into_disjoint_balanced_shares():
    """replica_share: the shares of the replicas of one (tp, pp, ep) position are disjoint and cover the stream,
    each within 4/3 of an even split by elements (LPT's bound), every replica computing the same split; one
    replica writes everything."""
    import torch

    from ckpt_transfer.convert.common import HFTensor, replica_share

    sizes = [1000, 700, 650, 300, 300, 120, 64, 64, 8, 8, 8]
    stream = [HFTensor(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    assert replica_share(stream, 0, 1) == stream
    for replicas in (2, 3):
        shares = [replica_share(list(stream), r, replicas) for r in range(replicas)]
        names = [t.name for share in shares for t in share]
        assert sorted(names) == sorted(t.name for t in stream) and len(set(names)) == len(stream)
        loads = [sum(t.tensor.numel() for t in share) for share in shares]
        assert max(loads) <= 4 / 3 * max(sum(sizes) / replicas, max(sizes)), loads
        assert all(loads)
        assert [t.name for t in replica_share(list(reversed(stream)), 0, replicas)] == \
            [t.name for t in reversed(shares[0])]  # the stream's order does not change who writes what
