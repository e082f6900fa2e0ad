"""DeepSeek-V3 family (DeepSeek-V3/R1, Kimi K2's architecture): Megatron-core GPTModel with multi-latent attention
(MLATransformerConfig, local spec) and a mixture of experts with shared experts <-> Hugging Face
`DeepseekV3ForCausalLM` in its per-expert checkpoint format, which both transformers and vLLM load.

Attention (MLA), per layer, Megatron <- HF:
- linear_q_down_proj <- q_a_proj, q_layernorm <- q_a_layernorm, linear_q_up_proj <- q_b_proj (or linear_q_proj
  <- q_proj when q_lora_rank is null); linear_kv_down_proj <- kv_a_proj_with_mqa (rows: the kv latent, then
  the shared rope key, the order Megatron splits them in), kv_layernorm <- kv_a_layernorm, linear_kv_up_proj
  <- kv_b_proj (per head: the no-rope key, then the value), linear_proj <- o_proj.
- Megatron's local spec builds the down projections as column-parallel linears, so under TP they are TP shards
  on dim 0 like the up projections (Megatron gathers their outputs); o_proj is a TP shard on dim 1.
- Rope: Megatron's MLA always de-interleaves the rope channels (x0, x2, ..., x1, x3, ...) and rotates halves,
  which is exactly transformers' `rope_interleave: true` (and what vLLM's DeepSeek model always does), so the
  weights need no permutation; `rope_interleave: false` is refused (vLLM would not compute it).

MLP: the first `first_k_dense_replace` layers are dense (`mlp.gate_proj/up_proj/down_proj`, width
intermediate_size); the others are MoE layers (Megatron's `moe_layer_freq` pattern): router `mlp.gate.weight`,
its `e_score_correction_bias` (Megatron's router `expert_bias`), routed experts
`mlp.experts.{e}.gate_proj/up_proj/down_proj` (local expert j on expert-parallel rank r is global expert
r * E / ep + j) and the shared experts `mlp.shared_experts.*` (Megatron's `mlp.shared_experts.linear_fc1/2`,
dense, TP-sharded like a dense MLP).

The expert bias: Megatron keeps it as a buffer that its finalize step moves towards balanced expert loads
(`moe_router_bias_update_rate`). In RL the policy is the released model and the bias is part of it, so here it
stays fixed: `layer_spec` builds the router as `FixedExpertBiasRouter`, whose bias is a parameter without
gradient (loaded, published and checkpointed like the weights, never touched by the optimizer) and which is
marked frozen for Megatron's load-balancing update (whose rate is also set to 0).

Multi-token-prediction layers (`num_nextn_predict_layers`, stored as `model.layers.{num_hidden_layers + k}.*`)
are not part of the main model's forward (transformers ignores them; vLLM only uses them for speculative
decoding, which tide does not configure): they are not loaded, not trained and not published.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import torch

from .common import (
    LAYER_PARAM,
    ConversionError,
    HFStream,
    HFTensor,
    RankLayout,
    TensorGetter,
    decoder_kwargs,
    tp_slice,
)
from .support import Refusal, common_problems, refuse_all, rope_parameters

# yarn: DeepSeek-V3's and Kimi K2's released configs; Megatron's MLA implements it (YarnRotaryEmbedding, the
# softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(q head dim)), mapped in _rope_kwargs
ROPE_TYPES = ("default", "yarn")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

# Megatron sub-name in a layer -> (HF sub-name, tp_dim); None = replicated (written by TP rank 0).
_SIMPLE_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight", 0),
    "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight", 0),
    "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight", None),
    "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight", 0),
    "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight", 0),
    "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight", None),
    "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight", 0),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight", 1),
    "mlp.router.weight": ("mlp.gate.weight", None),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias", None),
}
# gated MLPs: Megatron's linear_fc1 holds [gate; up] of its TP shard -> HF prefix of gate_proj/up_proj
_GATED = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts."}
_TOP_LEVEL = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
    "output_layer.weight": ("lm_head.weight", 0),
    "decoder.final_layernorm.weight": ("model.norm.weight", None),
}


# ---- what is supported -------------------------------------------------------------------------------------
def _group_routing(hf_config: Any) -> tuple[int | None, int | None]:
    """(num_groups, group_topk) for Megatron, None when group limiting selects every expert anyway."""
    groups, chosen = int(getattr(hf_config, "n_group", None) or 1), int(getattr(hf_config, "topk_group", None) or 1)
    return (None, None) if groups <= 1 or chosen >= groups else (groups, chosen)


def _yarn_problems(hf_config: Any) -> Iterator[Refusal]:
    rope = rope_parameters(hf_config)
    if rope["rope_type"] != "yarn":
        return
    for field in ("factor", "original_max_position_embeddings"):
        if rope.get(field) is None:
            yield Refusal(f"rope_parameters.{field}", None, "yarn needs it (transformers' fallback from "
                          "max_position_embeddings is not implemented)")
    if rope.get("attention_factor") is not None:
        yield Refusal("rope_parameters.attention_factor", rope["attention_factor"], "an explicit yarn attention "
                      "factor is not implemented")
    if rope.get("truncate", True) is not True:
        yield Refusal("rope_parameters.truncate", rope["truncate"], "yarn without a rounded correction range is not "
                      "implemented")
    if not rope.get("mscale") and rope.get("mscale_all_dim"):
        yield Refusal("rope_parameters.mscale", rope.get("mscale"), "yarn with mscale_all_dim but no mscale is not "
                      "implemented")


def _routing_problems(hf_config: Any) -> Iterator[Refusal]:
    method = getattr(hf_config, "topk_method", "noaux_tc")
    if method != "noaux_tc":
        yield Refusal("topk_method", method, "only DeepSeek-V3's noaux_tc routing (sigmoid scores plus "
                      "e_score_correction_bias for the choice) is implemented")
    scoring = getattr(hf_config, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        yield Refusal("scoring_func", scoring, "only sigmoid router scores are implemented")
    if hf_config.num_experts_per_tok > 1 and not getattr(hf_config, "norm_topk_prob", True):
        yield Refusal("norm_topk_prob", False, "Megatron's sigmoid router always renormalises the top-k weights")
    if int(getattr(hf_config, "moe_layer_freq", 1) or 1) != 1:
        yield Refusal("moe_layer_freq", hf_config.moe_layer_freq, "transformers puts experts in every layer after "
                      "first_k_dense_replace; other patterns are not implemented")
    groups, chosen = _group_routing(hf_config)
    if groups is not None:
        if hf_config.n_routed_experts % groups:
            yield Refusal("n_group", groups, f"does not divide n_routed_experts ({hf_config.n_routed_experts})")
        # transformers scores a group by its 2 best experts, Megatron by its top_k / topk_group best
        if hf_config.num_experts_per_tok // chosen != 2:
            yield Refusal("topk_group", chosen, f"groups are scored by their top "
                          f"{hf_config.num_experts_per_tok // chosen} experts in Megatron (num_experts_per_tok "
                          "/ topk_group) but their top 2 in transformers; only num_experts_per_tok == 2 * "
                          "topk_group is implemented")


def problems(hf_config: Any) -> Iterator[Refusal]:
    yield from common_problems(hf_config, ROPE_TYPES)
    if getattr(hf_config, "rope_interleave", True) is False:
        yield Refusal("rope_interleave", False, "vLLM's DeepSeek model always rotates interleaved rope channels "
                      "(as Megatron's MLA does); the non-interleaved variant is not implemented")
    yield from _yarn_problems(hf_config)
    if getattr(hf_config, "attention_bias", False):
        yield Refusal("attention_bias", True, "Megatron's multi-latent attention has no projection biases")
    yield from _routing_problems(hf_config)


def check_supported(hf_config: Any) -> None:
    refuse_all(hf_config, [problems])


# ---- Megatron model ----------------------------------------------------------------------------------------
def _rope_kwargs(hf_config: Any) -> dict[str, Any]:
    rope = rope_parameters(hf_config)
    theta = float(rope.get("rope_theta") or 10000.0)
    if rope["rope_type"] != "yarn":
        # mscale_all_dim 0 keeps the softmax scale at 1/sqrt(q head dim) (Megatron applies yarn's scale otherwise)
        return {"rope_type": "rope", "rotary_base": theta, "mscale_all_dim": 0.0}
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim") or 0.0
    # transformers: cos/sin scaled by mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set, else by
    # mscale(f); the softmax by mscale(f, mscale_all_dim)^2 when mscale_all_dim is set. Megatron computes the same
    # from (mscale, mscale_all_dim) = (1, 0) in the second case.
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    return {"rope_type": "yarn", "rotary_base": theta, "rotary_scaling_factor": float(rope["factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim)}


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """Megatron's moe_layer_freq: 0 for the first_k_dense_replace dense layers, then 1 (MoE)."""
    dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    return [0 if i < dense else 1 for i in range(hf_config.num_hidden_layers)]


def megatron_transformer_kwargs(hf_config: Any) -> Mapping[str, Any]:
    check_supported(hf_config)
    heads = hf_config.num_attention_heads
    shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
    groups, chosen = _group_routing(hf_config)
    return dict(
        **decoder_kwargs(hf_config),
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=hf_config.v_head_dim,  # the local attention's value head width (see _mla_core_attention)
        add_qkv_bias=False,
        qk_layernorm=True,  # MLA: the q and kv latents' RMSNorms
        multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        **_rope_kwargs(hf_config),
        num_moe_experts=hf_config.n_routed_experts,
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size * shared if shared else None,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # the bias is part of the model being trained: see the docstring
        moe_router_num_groups=groups,
        moe_router_group_topk=chosen,
        moe_router_topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        moe_router_dtype="fp32",  # transformers computes router logits in float32
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
    )


def transformer_config_class():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig


def _fixed_expert_bias_router():
    from megatron.core.transformer.moe.router import TopKRouter

    class FixedExpertBiasRouter(TopKRouter):
        """TopKRouter whose expert bias is a parameter without gradient and is never load-balanced."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.frozen_expert_bias = True  # skipped by Megatron's expert-bias update
            bias = self._buffers.pop("expert_bias")
            self.expert_bias = torch.nn.Parameter(bias, requires_grad=False)

    return FixedExpertBiasRouter


def _mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """Megatron's local (unfused, non-Transformer-Engine) attention for MLA. MLASelfAttention passes the key and
        value head widths as `k_channels`/`v_channels`, which only TEDotProductAttention accepts; the local kernel
        takes the key width from its inputs and the value width from config.kv_channels (set to v_head_dim)."""

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
                raise ValueError(f"MLA value heads of {v_channels} channels need config.kv_channels = {v_channels}")

    return MLADotProductAttention


def layer_spec(hf_config: Any, config):
    """This pipeline stage's layer specs: Megatron's local (no Transformer Engine) MLA layers, dense for the
    first first_k_dense_replace layers (config.moe_layer_freq), MoE with shared experts after."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    router, core_attention = _fixed_expert_bias_router(), _mla_core_attention()

    def adapt(spec):
        attention = spec.submodules.self_attention
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, core_attention=core_attention))
        layer = dataclasses.replace(spec.submodules, self_attention=attention)
        mlp = layer.mlp
        if isinstance(mlp, partial) and mlp.func is MoELayer:
            moe = dataclasses.replace(mlp.keywords["submodules"], router=router)
            layer = dataclasses.replace(layer, mlp=partial(MoELayer, *mlp.args, **{**mlp.keywords, "submodules": moe}))
        return dataclasses.replace(spec, submodules=layer)

    block.layer_specs = [adapt(s) for s in block.layer_specs]
    return block  # under sequence parallelism trainer/megatron/model.py swaps its torch norms for ones that allow it


# ---- conversion --------------------------------------------------------------------------------------------
def _global_expert(local: int, layout: RankLayout, hf_config: Any) -> int:
    return layout.ep_rank * (hf_config.n_routed_experts // layout.ep_size) + local


def _hf_name(mname: str, layout: RankLayout) -> tuple[str, int | None] | None:
    """HF name and tp_dim of a Megatron parameter with a one-to-one HF counterpart; None otherwise."""
    if mname in _TOP_LEVEL:
        return _TOP_LEVEL[mname]
    m = LAYER_PARAM.match(mname)
    if m and m.group(2) in _SIMPLE_LAYER:
        hf_sub, dim = _SIMPLE_LAYER[m.group(2)]
        return f"model.layers.{layout.global_layer(int(m.group(1)))}.{hf_sub}", dim
    return None


def megatron_to_hf(params: Iterable[tuple[str, torch.Tensor]], hf_config: Any, layout: RankLayout) -> HFStream:
    """Convert one rank's local Megatron parameters into HF-named tensors (TP shards kept, PP and EP removed)."""
    tp = dict(tp_rank=layout.tp_rank, tp_size=layout.tp_size)
    lead = layout.tp_rank == 0

    def out(name: str, t: torch.Tensor, dim: int | None) -> HFTensor | None:
        if dim is None:
            return HFTensor(name, t) if lead else None
        return HFTensor(name, t) if layout.tp_size == 1 else HFTensor(name, t, tp_dim=dim, **tp)

    for mname, t in params:
        t = t.detach()
        m = LAYER_PARAM.match(mname)
        expert = _EXPERT.match(m.group(2)) if m else None
        if expert:
            if not layout.writes_experts:
                continue
            e = _global_expert(int(expert.group(1)), layout, hf_config)
            prefix = f"model.layers.{layout.global_layer(int(m.group(1)))}.mlp.experts.{e}."
        elif not layout.writes_dense:
            continue
        else:
            prefix = None
        tensors: list[HFTensor | None]
        if expert and expert.group(2) == "linear_fc1":
            gate, up = (x.contiguous() for x in t.chunk(2, dim=0))
            tensors = [out(prefix + "gate_proj.weight", gate, 0), out(prefix + "up_proj.weight", up, 0)]
        elif expert:
            tensors = [out(prefix + "down_proj.weight", t, 1)]
        elif mname == "output_layer.weight" and getattr(hf_config, "tie_word_embeddings", False):
            tensors = []
        elif (simple := _hf_name(mname, layout)) is not None:
            tensors = [out(simple[0], t, simple[1])]
        elif m and m.group(2) in _GATED:
            hf_prefix = f"model.layers.{layout.global_layer(int(m.group(1)))}.{_GATED[m.group(2)]}"
            gate, up = (x.contiguous() for x in t.chunk(2, dim=0))
            tensors = [out(hf_prefix + "gate_proj.weight", gate, 0), out(hf_prefix + "up_proj.weight", up, 0)]
        else:
            raise ConversionError(f"no Hugging Face mapping for Megatron parameter {mname!r}")
        yield from (x for x in tensors if x is not None)


def hf_to_megatron(get: TensorGetter, names: Iterable[str], hf_config: Any, layout: RankLayout) -> dict[str, torch.Tensor]:
    """Build one rank's local Megatron state dict (for the given Megatron parameter names) from full HF tensors,
    slicing this rank's TP shard and its experts."""
    r, n = layout.tp_rank, layout.tp_size
    state: dict[str, torch.Tensor] = {}
    for mname in names:
        m = LAYER_PARAM.match(mname)
        expert = _EXPERT.match(m.group(2)) if m else None
        if expert:
            e = _global_expert(int(expert.group(1)), layout, hf_config)
            prefix = f"model.layers.{layout.global_layer(int(m.group(1)))}.mlp.experts.{e}."
            if expert.group(2) == "linear_fc1":
                state[mname] = torch.cat([tp_slice(get(prefix + "gate_proj.weight"), 0, r, n),
                                          tp_slice(get(prefix + "up_proj.weight"), 0, r, n)], dim=0)
            else:
                state[mname] = tp_slice(get(prefix + "down_proj.weight"), 1, r, n)
        elif mname == "output_layer.weight" and getattr(hf_config, "tie_word_embeddings", False):
            state[mname] = tp_slice(get("model.embed_tokens.weight"), 0, r, n)
        elif (simple := _hf_name(mname, layout)) is not None:
            t = get(simple[0])
            state[mname] = t if simple[1] is None else tp_slice(t, simple[1], r, n)
        elif m and m.group(2) in _GATED:
            hf_prefix = f"model.layers.{layout.global_layer(int(m.group(1)))}.{_GATED[m.group(2)]}"
            state[mname] = torch.cat([tp_slice(get(hf_prefix + "gate_proj.weight"), 0, r, n),
                                      tp_slice(get(hf_prefix + "up_proj.weight"), 0, r, n)], dim=0)
        else:
            raise ConversionError(f"no Hugging Face source for Megatron parameter {mname!r}")
    return state

