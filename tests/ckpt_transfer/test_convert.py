"""Layout rules of the dense Megatron <-> HF conversion, on random tensors (no Megatron process needed)."""
import pytest
import torch
from types import SimpleNamespace

from ckpt_transfer.convert import AttentionShape, ConversionError, RankLayout, fuse_qkv, split_qkv, tp_slice
from ckpt_transfer.convert import dense


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
            merged = parts[0].value()
        else:
            merged = torch.cat([p.value() for p in sorted(parts, key=lambda p: p.tp_rank)], dim=parts[0].tp_dim)
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
