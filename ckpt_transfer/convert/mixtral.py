"""Mixture-of-experts families whose attention is the dense family's: Mixtral and Qwen3-MoE. Megatron-core
MoE GPTModel (local spec, SequentialMLP experts, top-k router) <-> Hugging Face in its per-expert checkpoint
format, which both transformers and vLLM load:
- Mixtral: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w2/w3`;
- Qwen3-MoE: `mlp.gate`, `mlp.experts.{e}.gate_proj/down_proj/up_proj` (and q/k norms, see dense).

Attention, norms and embeddings follow the dense rules. Experts: local expert j on expert-parallel rank r is
global expert r * E / ep + j (this removes expert parallelism); gate and up are the halves of linear_fc1, down
is linear_fc2, with expert tensor parallelism sharding them like a dense MLP. Routing: Megatron's router with
`moe_router_pre_softmax=False` takes the top-k logits and softmaxes over them, which equals softmax, top-k,
renormalise (Mixtral; Qwen3-MoE with norm_topk_prob); with `pre_softmax=True` it softmaxes over all experts
and keeps the top-k probabilities as they are (Qwen3-MoE without norm_topk_prob).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

from . import dense
from .common import HFStream, HFTensor, RankLayout, TensorGetter, tp_slice
from .support import Refusal, refuse_all

_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$")


@dataclass(frozen=True)
class MoENames:
    """Where a family keeps its router and experts in the HF checkpoint."""

    block: str  # the MoE block of a layer
    gate: str
    up: str
    down: str
    num_experts_field: str
    ffn_field: str  # the width of one expert


MIXTRAL = MoENames("block_sparse_moe", "w1", "w3", "w2", "num_local_experts", "intermediate_size")
QWEN3_MOE = MoENames("mlp", "gate_proj", "up_proj", "down_proj", "num_experts", "moe_intermediate_size")
NAMES = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE}


def _names(hf_config: Any) -> MoENames:
    return NAMES[hf_config.model_type]


def _global_expert(local: int, layout: RankLayout, hf_config: Any) -> int:
    per_rank = getattr(hf_config, _names(hf_config).num_experts_field) // layout.ep_size
    return layout.ep_rank * per_rank + local


def megatron_to_hf(params: Iterable[tuple[str, torch.Tensor]], hf_config: Any, layout: RankLayout) -> HFStream:
    nm = _names(hf_config)
    rest = []
    for mname, t in params:
        t = t.detach()
        if m := _ROUTER.match(mname):
            if layout.writes_dense and layout.tp_rank == 0:
                i = layout.global_layer(int(m.group(1)))
                yield HFTensor(f"model.layers.{i}.{nm.block}.gate.weight", t)
        elif m := _EXPERT.match(mname):
            if not layout.writes_experts:
                continue
            i = layout.global_layer(int(m.group(1)))
            e = _global_expert(int(m.group(2)), layout, hf_config)
            prefix = f"model.layers.{i}.{nm.block}.experts.{e}."
            sharded = layout.tp_size > 1
            kw = dict(tp_rank=layout.tp_rank, tp_size=layout.tp_size) if sharded else {}
            if m.group(3) == "linear_fc1":
                gate, up = (x.contiguous() for x in t.chunk(2, dim=0))
                yield HFTensor(f"{prefix}{nm.gate}.weight", gate, tp_dim=0 if sharded else None, **kw)
                yield HFTensor(f"{prefix}{nm.up}.weight", up, tp_dim=0 if sharded else None, **kw)
            else:
                yield HFTensor(f"{prefix}{nm.down}.weight", t, tp_dim=1 if sharded else None, **kw)
        else:
            rest.append((mname, t))
    yield from dense.megatron_to_hf(rest, hf_config, layout)


def hf_to_megatron(get: TensorGetter, names: Iterable[str], hf_config: Any, layout: RankLayout) -> dict[str, torch.Tensor]:
    nm = _names(hf_config)
    r, n = layout.tp_rank, layout.tp_size
    out, rest = {}, []
    for mname in names:
        if m := _ROUTER.match(mname):
            out[mname] = get(f"model.layers.{layout.global_layer(int(m.group(1)))}.{nm.block}.gate.weight")
        elif m := _EXPERT.match(mname):
            i = layout.global_layer(int(m.group(1)))
            e = _global_expert(int(m.group(2)), layout, hf_config)
            prefix = f"model.layers.{i}.{nm.block}.experts.{e}."
            if m.group(3) == "linear_fc1":
                out[mname] = torch.cat([tp_slice(get(f"{prefix}{nm.gate}.weight"), 0, r, n),
                                        tp_slice(get(f"{prefix}{nm.up}.weight"), 0, r, n)], dim=0)
            else:
                out[mname] = tp_slice(get(f"{prefix}{nm.down}.weight"), 1, r, n)
        else:
            rest.append(mname)
    out.update(dense.hf_to_megatron(get, rest, hf_config, layout))
    return out


def problems(hf_config: Any) -> Iterator[Refusal]:
    yield from dense.problems(hf_config)
    if getattr(hf_config, "router_jitter_noise", 0.0):
        yield Refusal("router_jitter_noise", hf_config.router_jitter_noise, "router noise has no Megatron equivalent")
    if hf_config.model_type == "qwen3_moe":
        if getattr(hf_config, "decoder_sparse_step", 1) != 1:
            yield Refusal("decoder_sparse_step", hf_config.decoder_sparse_step, "only models with experts in every "
                          "layer are implemented")
        if getattr(hf_config, "mlp_only_layers", None):
            yield Refusal("mlp_only_layers", hf_config.mlp_only_layers, "only models with experts in every layer "
                          "are implemented")


def check_supported(hf_config: Any) -> None:
    refuse_all(hf_config, [problems])


def megatron_transformer_kwargs(hf_config: Any) -> Mapping[str, Any]:
    check_supported(hf_config)
    nm = _names(hf_config)
    kw = dict(dense.megatron_transformer_kwargs(hf_config))  # checks the rest
    renormalise = hf_config.model_type == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", False))
    kw.update(
        num_moe_experts=getattr(hf_config, nm.num_experts_field),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=getattr(hf_config, nm.ffn_field),
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        moe_router_pre_softmax=not renormalise,
    )
    return kw
