"""Dense decoder family (Qwen2, Qwen3, Llama 2/3.x, Mistral): Megatron-core GPTModel (local spec) <-> Hugging Face.

Megatron names are those of `GPTModel` built with the local layer spec; HF names are those of
`Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `LlamaForCausalLM`. Layout rules:
- QKV: Megatron fuses q, k, v per query group; each TP rank holds whole groups, so a rank's q/k/v rows are a
  contiguous TP shard (dim 0) of HF's q_proj/k_proj/v_proj.
- gated MLP: Megatron's linear_fc1 holds [gate; up] of its own TP shard, so it splits into HF gate_proj and
  up_proj shards on dim 0.
- row-parallel o_proj/down_proj are TP shards on dim 1; vocabulary-parallel embedding and lm_head on dim 0.
- norms are replicated: written by TP rank 0 only. Qwen3's q_norm/k_norm (RMSNorm over each head's
  channels, before rope) are Megatron's q_layernorm/k_layernorm (`qk_layernorm`), also per head.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import torch

from .common import (LAYER_PARAM, AttentionShape, ConversionError, HFStream, HFTensor, RankLayout, TensorGetter,
                     decoder_kwargs, fuse_qkv, split_qkv_views, tp_slice)
from .support import Refusal, common_problems, refuse_all

# Megatron sub-name in a layer -> (HF sub-name, tp_dim); None = replicated.
_SIMPLE_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
}
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")


def problems(hf_config: Any) -> Iterator[Refusal]:
    yield from common_problems(hf_config)
    if hf_config.model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        yield Refusal("attention_bias", True, "attention biases are implemented for qwen2's q/k/v projections only")


def check_supported(hf_config: Any) -> None:
    refuse_all(hf_config, [problems])


def megatron_to_hf(params: Iterable[tuple[str, torch.Tensor]], hf_config: Any, layout: RankLayout,
                   more_layer: Mapping[str, tuple[str, int | None]] | None = None) -> HFStream:
    """Convert one rank's local Megatron parameters into HF-named tensors (TP shards kept, PP removed).
    `more_layer`: a family's own one-to-one layer tensors beside the dense ones (Megatron sub-name -> (HF sub-name,
    tp_dim)), converted by the same rules."""
    simple = {**_SIMPLE_LAYER, **(more_layer or {})}
    if not layout.writes_dense:
        return
    att = AttentionShape.from_hf(hf_config)
    tp = dict(tp_rank=layout.tp_rank, tp_size=layout.tp_size)
    lead = layout.tp_rank == 0  # replicated tensors come from TP rank 0 only

    def shard(name: str, t: torch.Tensor, dim: int | None, shape: tuple[int, ...] | None = None) -> HFTensor | None:
        if dim is None:
            return HFTensor(name, t, 0, 1, None, shape) if lead else None
        if layout.tp_size == 1:
            return HFTensor(name, t, 0, 1, None, shape)
        return HFTensor(name, t, tp_dim=dim, shape=shape, **tp)

    for mname, t in params:
        t = t.detach()
        out: list[HFTensor | None] = []
        if mname == "embedding.word_embeddings.weight":
            out.append(shard("model.embed_tokens.weight", t, 0))
        elif mname == "output_layer.weight":
            if not getattr(hf_config, "tie_word_embeddings", False):
                out.append(shard("lm_head.weight", t, 0))
        elif mname == "decoder.final_layernorm.weight":
            out.append(shard("model.norm.weight", t, None))
        elif m := LAYER_PARAM.match(mname):
            prefix = f"model.layers.{layout.global_layer(int(m.group(1)))}."
            sub = m.group(2)
            if sub in simple:
                hf_sub, dim = simple[sub]
                out.append(shard(prefix + hf_sub, t, dim))
            elif sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = sub.rsplit(".", 1)[1]
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), split_qkv_views(t, att, layout.tp_size)):
                    hf_shape = (part.shape[0] * part.shape[1], *part.shape[2:])
                    out.append(shard(f"{prefix}self_attn.{proj}.{kind}", part, 0, hf_shape))
            elif sub == "mlp.linear_fc1.weight":
                gate, up = t.chunk(2, dim=0)
                out.append(shard(prefix + "mlp.gate_proj.weight", gate.contiguous(), 0))
                out.append(shard(prefix + "mlp.up_proj.weight", up.contiguous(), 0))
            else:
                raise ConversionError(f"no Hugging Face mapping for Megatron parameter {mname!r}")
        else:
            raise ConversionError(f"no Hugging Face mapping for Megatron parameter {mname!r}")
        yield from (x for x in out if x is not None)


def hf_to_megatron(get: TensorGetter, names: Iterable[str], hf_config: Any, layout: RankLayout,
                   more_layer: Mapping[str, tuple[str, int | None]] | None = None) -> dict[str, torch.Tensor]:
    """Build one rank's local Megatron state dict (for the given Megatron parameter names) from full HF
    tensors, slicing this rank's TP shard (`more_layer` as in megatron_to_hf)."""
    simple = {**_SIMPLE_LAYER, **(more_layer or {})}
    att = AttentionShape.from_hf(hf_config)
    r, n = layout.tp_rank, layout.tp_size
    out: dict[str, torch.Tensor] = {}
    for mname in names:
        if mname == "embedding.word_embeddings.weight":
            out[mname] = tp_slice(get("model.embed_tokens.weight"), 0, r, n)
        elif mname == "output_layer.weight":
            key = "model.embed_tokens.weight" if getattr(hf_config, "tie_word_embeddings", False) else "lm_head.weight"
            out[mname] = tp_slice(get(key), 0, r, n)
        elif mname == "decoder.final_layernorm.weight":
            out[mname] = get("model.norm.weight")
        elif m := LAYER_PARAM.match(mname):
            prefix = f"model.layers.{layout.global_layer(int(m.group(1)))}."
            sub = m.group(2)
            if sub in simple:
                hf_sub, dim = simple[sub]
                t = get(prefix + hf_sub)
                out[mname] = t if dim is None else tp_slice(t, dim, r, n)
            elif sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = sub.rsplit(".", 1)[1]
                q, k, v = (tp_slice(get(f"{prefix}self_attn.{p}.{kind}"), 0, r, n) for p in ("q_proj", "k_proj", "v_proj"))
                out[mname] = fuse_qkv(q, k, v, att, n)
            elif sub == "mlp.linear_fc1.weight":
                gate = tp_slice(get(prefix + "mlp.gate_proj.weight"), 0, r, n)
                up = tp_slice(get(prefix + "mlp.up_proj.weight"), 0, r, n)
                out[mname] = torch.cat([gate, up], dim=0)
            else:
                raise ConversionError(f"no Hugging Face source for Megatron parameter {mname!r}")
        else:
            raise ConversionError(f"no Hugging Face source for Megatron parameter {mname!r}")
    return out


def megatron_transformer_kwargs(hf_config: Any) -> Mapping[str, Any]:
    """TransformerConfig fields that describe this HF architecture."""
    check_supported(hf_config)
    att = AttentionShape.from_hf(hf_config)
    return dict(
        **decoder_kwargs(hf_config),
        num_attention_heads=att.num_heads,
        num_query_groups=att.num_kv_heads,
        kv_channels=att.head_dim,
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in QK_NORM_FAMILIES,
    )
