"""Megatron <-> Hugging Face conversion, one module per architecture family."""
from __future__ import annotations

from types import ModuleType
from typing import Any

from . import deepseek_v3, dense, gpt_oss, mixtral
from .common import AttentionShape, ConversionError, HFTensor, RankLayout, fuse_qkv, split_qkv, tp_slice
from .engine_config import engine_problems
from .support import UnsupportedModelError, refuse_all

# model_type -> the module converting it; each has problems, check_supported, megatron_transformer_kwargs,
# hf_to_megatron and megatron_to_hf, and may have transformer_config_class and layer_spec (trainer/megatron/model.py)
_FAMILIES = {"qwen2": dense, "qwen3": dense, "llama": dense, "mistral": dense, "mixtral": mixtral,
             "qwen3_moe": mixtral, "deepseek_v3": deepseek_v3,
             "gpt_oss": gpt_oss}


def family(hf_config: Any) -> ModuleType:
    try:
        return _FAMILIES[hf_config.model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"config.json field model_type = {hf_config.model_type!r}: no converter for this architecture "
            f"(supported: {', '.join(sorted(_FAMILIES))})") from None


def is_moe(hf_config: Any) -> bool:
    return any(getattr(hf_config, f, None) for f in ("num_local_experts", "num_experts", "n_routed_experts"))


def stacks_experts(hf_config: Any) -> bool:
    """Whether the family's checkpoint holds each layer's experts as one tensor (gpt_oss), not a module per expert."""
    return getattr(family(hf_config), "STACKED_EXPERTS", False)


def check_supported(hf_config: Any) -> None:
    """Raise UnsupportedModelError naming every config.json field whose computation the trainer would not
    reproduce, or the engines (vLLM) would not compute as transformers does (engine_config.engine_problems), each
    as the file names it (support.refuse_all)."""
    refuse_all(hf_config, [lambda c: family(c).problems(c), engine_problems])


__all__ = ["family", "check_supported", "is_moe", "stacks_experts", "UnsupportedModelError", "AttentionShape",
           "ConversionError", "HFTensor", "RankLayout", "fuse_qkv", "split_qkv", "tp_slice"]
