"""Megatron <-> Hugging Face conversion, one module per architecture family."""
from __future__ import annotations

from types import ModuleType
from typing import Any

from . import dense, mixtral
from .common import AttentionShape, ConversionError, HFTensor, RankLayout, fuse_qkv, split_qkv, tp_slice

_FAMILIES = {"qwen2": dense, "llama": dense, "mistral": dense, "mixtral": mixtral}


def family(hf_config: Any) -> ModuleType:
    try:
        return _FAMILIES[hf_config.model_type]
    except KeyError:
        raise ConversionError(
            f"model_type {hf_config.model_type!r} has no converter (supported: {', '.join(sorted(_FAMILIES))})"
        ) from None


__all__ = ["family", "AttentionShape", "ConversionError", "HFTensor", "RankLayout", "fuse_qkv", "split_qkv", "tp_slice"]
