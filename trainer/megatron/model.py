"""Megatron-core GPTModel built from a Hugging Face config (local layer spec: no Transformer Engine/apex)."""
from __future__ import annotations

from typing import Any

import torch


def rope_theta(hf_config: Any) -> float:
    from ckpt_transfer.convert.support import rope_parameters

    return float(rope_parameters(hf_config).get("rope_theta") or 10000.0)


def rope_inv_freq(hf_config: Any, attention_factor_applied: bool = False) -> torch.Tensor | None:
    """The rotary inverse frequencies of a scaled rope (llama3, linear, yarn), computed by transformers' own init
    function for the model, so the trainer rotates by exactly the angles transformers and vLLM use; None for
    plain rope (Megatron's own, from rotary_base). Megatron's llama3 scaling hard-codes Llama 3.1's
    low/high frequency factors and original context, so it is not used. A rope type that also scales attention
    (yarn) is refused unless the family applies that factor (`attention_factor_applied`: gpt_oss folds it into
    the softmax scale)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ckpt_transfer.convert.support import rope_parameters

    kind = rope_parameters(hf_config)["rope_type"]
    if kind == "default":
        return None
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    if attention_factor != 1.0 and not attention_factor_applied:
        raise ValueError(f"rope type {kind!r} scales attention by {attention_factor}: not implemented")
    return inv_freq.float()


class LayoutError(ValueError):
    """The model cannot be split the way trainer.parallel asks."""


def check_layout(arch: dict, *, vocab_size: int, tp: int, pp: int, ep: int) -> None:
    rules = [
        ("num_key_value_heads", arch["num_query_groups"], tp, "trainer.parallel.tp"),
        ("num_attention_heads", arch["num_attention_heads"], tp, "trainer.parallel.tp"),
        ("intermediate_size", arch["ffn_hidden_size"], tp, "trainer.parallel.tp"),
        ("vocab_size", vocab_size, tp, "trainer.parallel.tp"),
        ("num_hidden_layers", arch["num_layers"], pp, "trainer.parallel.pp"),
    ]
    if arch.get("num_moe_experts"):
        rules.append(("num_local_experts", arch["num_moe_experts"], ep, "trainer.parallel.ep"))
    elif ep > 1:
        raise LayoutError("trainer.parallel.ep > 1 needs a mixture-of-experts model")
    for what, size, parts, knob in rules:
        if size % parts:
            raise LayoutError(f"the model's {what} ({size}) is not divisible by {knob} ({parts})")


# trainer.recompute as megatron-core 0.19's TransformerConfig fields: `selective` checkpoints the core attention
# (its output is recomputed from q, k, v in the backward pass), `full` each transformer layer (only its input kept;
# "uniform" with one layer per unit: every layer its own checkpoint)
RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def transformer_config(hf_config: Any, *, tp: int, pp: int, ep: int, dtype: torch.dtype, deterministic: bool,
                       recompute: str = "none"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ckpt_transfer.convert import family

    fam = family(hf_config)
    arch = dict(fam.megatron_transformer_kwargs(hf_config))
    check_layout(arch, vocab_size=hf_config.vocab_size, tp=tp, pp=pp, ep=ep)
    arch.setdefault("activation_func", torch.nn.functional.silu)
    config_class = getattr(fam, "transformer_config_class", lambda: TransformerConfig)()
    return config_class(
        **arch,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tensor_parallel_size(hf_config, tp),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        deterministic_mode=deterministic,
        # Megatron refuses MoE layers under tensor parallelism without it (the experts' token dispatch expects
        # sequence-split activations)
        sequence_parallel=tp > 1 and bool(arch.get("num_moe_experts")),
        **RECOMPUTE[recompute],
    )


def expert_tensor_parallel_size(hf_config: Any, tp: int) -> int:
    """Megatron's expert tensor parallelism: the tensor-parallel degree (Megatron's default), or 1 where the
    family's experts cannot be split (gpt_oss: Megatron splits no biased experts)."""
    from ckpt_transfer.convert import family

    return tp if getattr(family(hf_config), "EXPERT_TENSOR_PARALLEL", True) else 1


def layer_spec(hf_config: Any, config, attention: str = "sdpa"):
    """The Megatron layer spec of the model: the family's own (heterogeneous layers, multi-latent attention), else
    the local spec (no Transformer Engine) of a uniform decoder; `attention` sdpa: its core attention on torch's
    scaled_dot_product_attention (trainer/megatron/attention.py), eager: Megatron's local one."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ckpt_transfer.convert import family

    own = getattr(family(hf_config), "layer_spec", None)
    if own is not None:
        spec = own(hf_config, config)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                        qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if attention == "sdpa":
        spec = _with_fused_attention(spec)
    elif attention != "eager":
        raise ValueError(f"trainer.attention {attention!r}: expected sdpa or eager")
    return _with_sequence_parallel_norms(spec, config) if config.sequence_parallel else spec


def _swapped(node, swap):
    """A copy of the spec tree `node` with each module class `c` replaced by `swap(c)`."""
    import copy
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    def walk(node):
        if isinstance(node, type):
            return swap(node)
        if isinstance(node, ModuleSpec):
            node.module, node.submodules = walk(node.module), walk(node.submodules)
        elif dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                setattr(node, f.name, walk(getattr(node, f.name)))
        elif isinstance(node, list):
            return [walk(x) for x in node]
        return node

    return walk(copy.deepcopy(node))


def _with_fused_attention(spec):
    """The spec with every core attention (DotProductAttention or a family's subclass of it) on SDPA."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from trainer.megatron.attention import fused_attention_class

    return _swapped(spec, lambda c: fused_attention_class(c) if issubclass(c, DotProductAttention) else c)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for sequence-parallel models. Megatron's torch-norm wrapper refuses sequence parallelism
    (its fused norms come from Transformer Engine or apex, neither available here): each tensor-parallel rank
    then normalises a different slice of the positions, so the weight's gradient is a partial sum. Marked
    `sequence_parallel`, Megatron's finalize_model_grads sums it over the tensor-parallel ranks, as it does for
    Transformer Engine's norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _with_sequence_parallel_norms(spec, config):
    """The spec as a block spec (the final norm included) with every torch norm a SequenceParallelRMSNorm."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if config.normalization != "RMSNorm":
        raise ValueError("sequence parallelism is implemented for RMSNorm models only")
    if isinstance(spec, ModuleSpec) and not isinstance(spec.submodules, TransformerBlockSubmodules):
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=WrappedTorchNorm)
    return _swapped(spec, lambda c: SequenceParallelRMSNorm if c is WrappedTorchNorm else c)


def build_gpt(hf_config: Any, config, *, pre_process: bool, post_process: bool, attention: str = "sdpa"):
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(hf_config, config, attention),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    # multi-latent attention keeps its own rope (plain or yarn) in each attention module: TransformerConfig fields
    from ckpt_transfer.convert import family

    inv_freq = None if config.multi_latent_attention else rope_inv_freq(
        hf_config, attention_factor_applied=getattr(family(hf_config), "ROPE_ATTENTION_FACTOR_IN_SOFTMAX_SCALE", False))
    if inv_freq is not None:
        rotary = model.rotary_pos_emb
        if rotary.inv_freq.shape != inv_freq.shape:
            raise ValueError(f"rope frequencies {tuple(inv_freq.shape)} do not fit Megatron's "
                             f"{tuple(rotary.inv_freq.shape)}")
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
        rotary.forward.cache_clear()  # the embedding is cached per sequence length; none was computed yet
    return model
