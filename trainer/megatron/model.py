"""Megatron-core GPTModel built from a Hugging Face config (local layer spec: no Transformer Engine/apex)."""
from __future__ import annotations

from typing import Any

import torch


def rope_theta(hf_config: Any) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


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


def transformer_config(hf_config: Any, *, tp: int, pp: int, ep: int, dtype: torch.dtype, deterministic: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ckpt_transfer.convert import family

    arch = dict(family(hf_config).megatron_transformer_kwargs(hf_config))
    check_layout(arch, vocab_size=hf_config.vocab_size, tp=tp, pp=pp, ep=ep)
    return TransformerConfig(
        **arch,
        activation_func=torch.nn.functional.silu,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
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
    )


def build_gpt(hf_config: Any, config, *, pre_process: bool, post_process: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm"),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
