"""GPT-OSS family (gpt-oss-20b, gpt-oss-120b): Megatron-core MoE GPTModel (local spec) <-> Hugging Face
`GptOssForCausalLM` in its unquantized checkpoint format (the bf16 releases; MXFP4's `quantization_config` is
refused), which transformers and vLLM load.

What differs from the other MoE families, each a TransformerConfig field of megatron-core 0.19:
- attention sinks: one learnable logit per head (`self_attn.sinks`) in every softmax's denominator, Megatron's
  `softmax_type="learnable"` (`core_attention.softmax_offset`, a TP shard per head);
- alternating sliding-window attention: `layer_types` picks the layers, Megatron's `window_attn_skip_freq` as a
  per-layer list; transformers' window of W keys (the query's own and W - 1 before it) is Megatron's and
  FlashAttention's `window_size=(W - 1, 0)`;
- biases everywhere: q/k/v, o_proj, the router and every expert (`add_bias_linear`); Megatron keeps biased
  experts whole on each tensor-parallel rank (expert tensor parallelism 1, its own condition);
- the experts' clamped SwiGLU: gate clamped from above and up on both sides at `swiglu_limit`, then
  gate * sigmoid(1.702 gate) * (up + 1): Megatron's `quick_gelu` with `glu_linear_offset=1` and
  `activation_func_clamp_value`;
- routing: top-k of the router's logits, softmaxed over those k (Megatron's `moe_router_pre_softmax=False`);
- yarn rope (`truncate: false` in the releases): frequencies from transformers' own init function, and its
  attention factor, which transformers and vLLM multiply into both cos and sin, as the softmax scale's
  factor^2.

Checkpoint layout: a layer's experts are stacked in one tensor each, `mlp.experts.gate_up_proj` [E, hidden, 2 x
width] with gate and up interleaved by column (gate = [..., ::2], up = [..., 1::2]),
`mlp.experts.gate_up_proj_bias` [E, 2 x width], `mlp.experts.down_proj` [E, width, hidden] (x @ W, the transpose of
a linear layer's weight) and `down_proj_bias` [E, hidden]. Megatron keeps one linear_fc1 ([gate; up] rows) and
linear_fc2 per expert. Under expert parallelism, rank r holds global experts r * E / ep ... (r + 1) * E / ep - 1,
a contiguous block of the stacked tensors' first dimension: it publishes that block as shard r of ep along dim 0
(a shard record like a TP shard's; the engines' directory concatenates the shards, as it does TP shards).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from . import dense
from .common import LAYER_PARAM, ConversionError, HFStream, HFTensor, RankLayout, TensorGetter
from .support import Refusal, common_problems, refuse_all, rope_parameters

# Megatron allows expert biases only with expert tensor parallelism 1
EXPERT_TENSOR_PARALLEL = False
# each layer's experts one tensor in the checkpoint (mlp.experts.gate_up_proj, down_proj): no per-expert projection
STACKED_EXPERTS = True
# yarn's attention factor is in the softmax scale (megatron_transformer_kwargs)
ROPE_ATTENTION_FACTOR_IN_SOFTMAX_SCALE = True

ROPE_TYPES = ("default", "yarn")
QUICK_GELU_ALPHA = 1.702  # Megatron's quick_gelu: x * sigmoid(1.702 x)
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias)$")

# Megatron sub-name in a layer -> (HF sub-name, tp_dim), beside the dense family's (dense.megatron_to_hf's more_layer)
_MORE_LAYER = {
    "self_attention.linear_proj.bias": ("self_attn.o_proj.bias", None),
    "self_attention.core_attention.softmax_offset": ("self_attn.sinks", 0),
    "mlp.router.weight": ("mlp.router.weight", None),
    "mlp.router.bias": ("mlp.router.bias", None),
}
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_type_problems(hf_config: Any) -> Iterator[Refusal]:
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers)
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        yield Refusal("layer_types", unknown, f"only {' and '.join(_LAYER_TYPES)} layers are implemented")
    if len(types) != hf_config.num_hidden_layers:
        yield Refusal("layer_types", types, f"{len(types)} entries for {hf_config.num_hidden_layers} layers")


def layer_types(hf_config: Any) -> list[str]:
    refuse_all(hf_config, [_layer_type_problems])
    return list(getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers)


def problems(hf_config: Any) -> Iterator[Refusal]:
    # the sliding windows and the activation are this family's own (checked here), the rest is common
    window = getattr(hf_config, "sliding_window", None)
    yield from _layer_type_problems(hf_config)
    types = list(getattr(hf_config, "layer_types", None) or [])
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        yield Refusal("sliding_window", window, "sliding_attention layers need a positive window")
    alpha = float(getattr(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        yield Refusal("swiglu_alpha", alpha, f"Megatron's quick_gelu computes gate * sigmoid({QUICK_GELU_ALPHA} gate)")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        yield Refusal("router_jitter_noise", hf_config.router_jitter_noise, "router noise has no Megatron equivalent")
    if not getattr(hf_config, "attention_bias", True):
        yield Refusal("attention_bias", False, "gpt_oss is implemented with its q/k/v/o biases")
    full_attention = _Overridden(hf_config, layer_types=None, sliding_window=None, use_sliding_window=False)
    yield from common_problems(full_attention, rope_types=ROPE_TYPES)


def check_supported(hf_config: Any) -> None:
    refuse_all(hf_config, [problems])


class _Overridden:
    """The config with some fields overridden, for the common checks."""

    def __init__(self, hf_config: Any, **fields: Any) -> None:
        self._config, self._fields = hf_config, fields

    def __getattr__(self, name: str) -> Any:
        return self._fields[name] if name in self._fields else getattr(self._config, name)


def rope_attention_factor(hf_config: Any) -> float:
    """yarn's attention factor (transformers' and vLLM's scale of cos and sin); 1 for plain rope."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = rope_parameters(hf_config)["rope_type"]
    if kind == "default":
        return 1.0
    return float(ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")[1])


def megatron_transformer_kwargs(hf_config: Any) -> Mapping[str, Any]:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    check_supported(hf_config)
    # the dense fields of the attention and norms; the dense family's own checks would refuse what is gpt_oss's
    as_dense = _Overridden(hf_config, model_type="gpt_oss_dense", attention_bias=False, layer_types=None,
                           sliding_window=None, rope_parameters={"rope_type": "default"}, rope_scaling=None)
    kw = dict(dense.megatron_transformer_kwargs(as_dense))
    types = layer_types(hf_config)
    head_dim = kw["kv_channels"]
    kw.update(
        add_bias_linear=True,
        add_qkv_bias=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf_config.swiglu_limit),
        softmax_type="learnable",
        softmax_scale=rope_attention_factor(hf_config) ** 2 / math.sqrt(head_dim),
        num_moe_experts=hf_config.num_local_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.intermediate_size,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        moe_router_pre_softmax=False,
    )
    if "sliding_attention" in types:
        kw.update(window_size=(hf_config.sliding_window - 1, 0),
                  window_attn_skip_freq=[int(t == "sliding_attention") for t in types])
    return kw


def _expert_output_linear():
    from megatron.core.tensor_parallel import RowParallelLinear

    class ExpertOutputLinear(RowParallelLinear):
        """An expert's linear_fc2 whose output is a tensor of its own. Megatron's MLP adds a biased expert's bias,
        weighted by the token's routing probability, into linear_fc2's output in place; with one rank in the
        expert's tensor-parallel group the row-parallel reduction hands back its input as is, and autograd forbids
        the in-place add on that custom Function's output (training stops with "Output 0 of
        _ReduceFromModelParallelRegion is a view and is being modified inplace"). One copy of each expert's
        output per forward."""

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            return output.clone(), bias

    return ExpertOutputLinear


def layer_spec(hf_config: Any, config):
    """Megatron's local MoE layer spec (no Transformer Engine) with the experts' ExpertOutputLinear."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=False,
                                    normalization="RMSNorm")
    moe = spec.submodules.mlp
    experts = moe.keywords["submodules"].experts
    experts = type(experts)(experts.func, *experts.args, **{**experts.keywords, "submodules": dataclasses.replace(
        experts.keywords["submodules"], linear_fc2=_expert_output_linear())})
    moe = type(moe)(moe.func, *moe.args, **{**moe.keywords, "submodules": dataclasses.replace(
        moe.keywords["submodules"], experts=experts)})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=moe))


def megatron_to_hf(params: Iterable[tuple[str, torch.Tensor]], hf_config: Any, layout: RankLayout) -> HFStream:
    experts: dict[int, dict[tuple[int, str, str], torch.Tensor]] = {}
    rest = []
    for mname, t in params:
        m = LAYER_PARAM.match(mname)
        if m and (e := _EXPERT.match(m.group(2))):
            if layout.writes_experts:
                layer = layout.global_layer(int(m.group(1)))
                experts.setdefault(layer, {})[(int(e.group(1)), e.group(2), e.group(3))] = t.detach()
        else:
            rest.append((mname, t))
    yield from dense.megatron_to_hf(rest, hf_config, layout, more_layer=_MORE_LAYER)
    local_experts = hf_config.num_local_experts // layout.ep_size
    for layer, parts in experts.items():
        yield from _stacked_experts(layer, parts, local_experts, layout)


def _stacked_experts(layer: int, parts: dict[tuple[int, str, str], torch.Tensor], local_experts: int,
                     layout: RankLayout) -> HFStream:
    """One layer's per-expert Megatron tensors of this rank -> the checkpoint's four stacked tensors (this
    expert-parallel rank's block of them)."""
    def stack(fc: str, kind: str) -> list[torch.Tensor]:
        missing = [e for e in range(local_experts) if (e, fc, kind) not in parts]
        if missing:
            raise ConversionError(f"layer {layer}: local experts {missing} have no {fc}.{kind}")
        return [parts[(e, fc, kind)] for e in range(local_experts)]

    def block(name: str, t: torch.Tensor) -> HFTensor:
        if layout.ep_size == 1:
            return HFTensor(name, t)
        return HFTensor(name, t, tp_rank=layout.ep_rank, tp_size=layout.ep_size, tp_dim=0)

    prefix = f"model.layers.{layer}.mlp.experts."
    # linear_fc1.weight [2w, hidden] = [gate; up] -> [hidden, 2w] with gate and up interleaved by column
    yield block(prefix + "gate_up_proj", torch.stack([_interleave(w, 0).T for w in stack("linear_fc1", "weight")]))
    yield block(prefix + "gate_up_proj_bias", torch.stack([_interleave(b, 0) for b in stack("linear_fc1", "bias")]))
    yield block(prefix + "down_proj", torch.stack([w.T for w in stack("linear_fc2", "weight")]))
    yield block(prefix + "down_proj_bias", torch.stack(stack("linear_fc2", "bias")))


def _interleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate; up] along `dim` -> gate and up alternating along it (gate_0, up_0, gate_1, ...)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _deinterleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """gate and up alternating along `dim` -> [gate; up] along it."""
    index = [slice(None)] * gate_up.dim()
    gate = gate_up[tuple(index[:dim] + [slice(0, None, 2)])]
    up = gate_up[tuple(index[:dim] + [slice(1, None, 2)])]
    return torch.cat([gate, up], dim=dim)


def hf_to_megatron(get: TensorGetter, names: Iterable[str], hf_config: Any,
                   layout: RankLayout) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    rest = []
    stacked: dict[str, torch.Tensor] = {}  # the current layer's stacked expert tensors, read once for all experts

    def expert_tensor(name: str) -> torch.Tensor:
        if name not in stacked:
            layer = name.split(".mlp.", 1)[0]
            for held in [k for k in stacked if not k.startswith(layer + ".")]:
                del stacked[held]
            stacked[name] = get(name)
        return stacked[name]

    for mname in names:
        m = LAYER_PARAM.match(mname)
        if m and (e := _EXPERT.match(m.group(2))):
            prefix = f"model.layers.{layout.global_layer(int(m.group(1)))}.mlp.experts."
            fc, kind = e.group(2), e.group(3)
            expert = layout.ep_rank * (hf_config.num_local_experts // layout.ep_size) + int(e.group(1))
            if fc == "linear_fc1":
                src = expert_tensor(prefix + ("gate_up_proj" if kind == "weight" else "gate_up_proj_bias"))[expert]
                out[mname] = _deinterleave(src.T if kind == "weight" else src, dim=0).contiguous()
            else:
                src = expert_tensor(prefix + ("down_proj" if kind == "weight" else "down_proj_bias"))[expert]
                out[mname] = (src.T if kind == "weight" else src).contiguous()
        else:
            rest.append(mname)
    out.update(dense.hf_to_megatron(get, rest, hf_config, layout, more_layer=_MORE_LAYER))
    return out
