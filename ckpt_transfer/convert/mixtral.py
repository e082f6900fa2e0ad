"""Mixture-of-experts family in the Mixtral layout: Megatron-core MoE GPTModel (local spec, SequentialMLP
experts, top-k router) <-> Hugging Face `MixtralForCausalLM` in its per-expert checkpoint format
(`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w2/w3`), which both transformers and vLLM load.

Attention, norms and embeddings follow the dense rules. Experts: local expert j on expert-parallel rank r is
global expert r * E / ep + j (this removes expert parallelism); w1 (gate) and w3 (up) are the halves of
linear_fc1, w2 is linear_fc2, with expert tensor parallelism sharding them like a dense MLP. Megatron's
router takes the top-k logits and softmaxes over them, which equals Mixtral's softmax, top-k, renormalise.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import torch

from . import dense
from .common import ConversionError, HFStream, HFTensor, RankLayout, TensorGetter, tp_slice

_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$")


def _num_experts(hf_config: Any) -> int:
    return hf_config.num_local_experts


def _global_expert(local: int, layout: RankLayout, hf_config: Any) -> int:
    per_rank = _num_experts(hf_config) // layout.ep_size
    return layout.ep_rank * per_rank + local


def megatron_to_hf(params: Iterable[tuple[str, torch.Tensor]], hf_config: Any, layout: RankLayout) -> HFStream:
    rest = []
    for mname, t in params:
        t = t.detach()
        if m := _ROUTER.match(mname):
            if layout.writes_dense and layout.tp_rank == 0:
                i = layout.global_layer(int(m.group(1)))
                yield HFTensor(f"model.layers.{i}.block_sparse_moe.gate.weight", t)
        elif m := _EXPERT.match(mname):
            if not layout.writes_experts:
                continue
            i = layout.global_layer(int(m.group(1)))
            e = _global_expert(int(m.group(2)), layout, hf_config)
            prefix = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            sharded = layout.tp_size > 1
            kw = dict(tp_rank=layout.tp_rank, tp_size=layout.tp_size) if sharded else {}
            if m.group(3) == "linear_fc1":
                gate, up = (x.contiguous() for x in t.chunk(2, dim=0))
                yield HFTensor(prefix + "w1.weight", gate, tp_dim=0 if sharded else None, **kw)
                yield HFTensor(prefix + "w3.weight", up, tp_dim=0 if sharded else None, **kw)
            else:
                yield HFTensor(prefix + "w2.weight", t, tp_dim=1 if sharded else None, **kw)
        else:
            rest.append((mname, t))
    yield from dense.megatron_to_hf(rest, hf_config, layout)


def hf_to_megatron(get: TensorGetter, names: Iterable[str], hf_config: Any, layout: RankLayout) -> dict[str, torch.Tensor]:
    r, n = layout.tp_rank, layout.tp_size
    out, rest = {}, []
    for mname in names:
        if m := _ROUTER.match(mname):
            out[mname] = get(f"model.layers.{layout.global_layer(int(m.group(1)))}.block_sparse_moe.gate.weight")
        elif m := _EXPERT.match(mname):
            i = layout.global_layer(int(m.group(1)))
            e = _global_expert(int(m.group(2)), layout, hf_config)
            prefix = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            if m.group(3) == "linear_fc1":
                out[mname] = torch.cat([tp_slice(get(prefix + "w1.weight"), 0, r, n),
                                        tp_slice(get(prefix + "w3.weight"), 0, r, n)], dim=0)
            else:
                out[mname] = tp_slice(get(prefix + "w2.weight"), 1, r, n)
        else:
            rest.append(mname)
    out.update(dense.hf_to_megatron(get, rest, hf_config, layout))
    return out


def megatron_transformer_kwargs(hf_config: Any) -> Mapping[str, Any]:
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ConversionError("router_jitter_noise > 0 has no Megatron equivalent")
    kw = dict(dense.megatron_transformer_kwargs(hf_config))
    kw.update(
        num_moe_experts=_num_experts(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.intermediate_size,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        moe_router_pre_softmax=False,
    )
    return kw
