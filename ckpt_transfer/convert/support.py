"""What tide's trainer computes of a Hugging Face architecture, checked before anything starts.

A config.json field that changes the model's computation and that the Megatron model would not reproduce is
refused by name (the run exits 2), instead of training a different function than the one vLLM samples from
and failing later at the log-prob gap check with a message about log-probs. The checks are per field, not per
model: a field at its neutral value (a null sliding window, a softcap of None, a rope scaling factor of 1) is
accepted.
"""
from __future__ import annotations

from typing import Any

from .common import ConversionError


class UnsupportedModelError(ConversionError):
    """The model's config asks for computation the trainer does not implement."""


# rope types whose frequencies the trainer sets from transformers' own init function (no attention factor,
# no sequence-length dependence); others need their own implementation
ROPE_TYPES_BY_FREQUENCY = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict:
    """The config's rope parameters in transformers 5's normalised form (`rope_parameters`, which transformers
    derives from a config.json's `rope_scaling` + `rope_theta`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("rope_parameters per layer type (different rope for different layers) is not "
                                    "supported")
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _refuse(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json field {field} = {value!r}: {why}")


def check_common(hf_config: Any, rope_types: tuple[str, ...] = ROPE_TYPES_BY_FREQUENCY) -> None:
    """Fields any decoder family may carry that the trainer does not compute."""
    rope = rope_parameters(hf_config)
    rope_field = "rope_scaling.rope_type" if getattr(hf_config, "rope_scaling", None) else "rope_parameters.rope_type"
    if rope["rope_type"] not in rope_types:
        raise _refuse(rope_field, rope["rope_type"], f"this rope type is not implemented for "
                      f"{hf_config.model_type} (supported: {', '.join(rope_types)})")
    if float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None),
                      "rotary embeddings on part of each head are not implemented")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "only silu (SwiGLU) MLPs are implemented")
    if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
        raise _refuse("sliding_window", hf_config.sliding_window, "sliding-window attention is not implemented "
                      "(use_sliding_window is true)")
    if hf_config.model_type == "mistral" and getattr(hf_config, "sliding_window", None):
        window = hf_config.sliding_window
        if window < getattr(hf_config, "max_position_embeddings", window):
            raise _refuse("sliding_window", window, "sliding-window attention is not implemented (set it to null "
                          "or to max_position_embeddings if the model was trained without it)")
    layer_types = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
    if layer_types - {"full_attention"}:
        raise _refuse("layer_types", sorted(layer_types), "only full attention layers are implemented")
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "attention_sink",
                  "use_qk_l2_norm", "query_pre_attn_scalar"):
        value = getattr(hf_config, field, None)
        if value not in (None, False, 0, 1, 1.0):
            raise _refuse(field, value, "not implemented by the trainer")
    if getattr(hf_config, "mlp_bias", False):
        raise _refuse("mlp_bias", True, "MLP biases are not implemented")
    if getattr(hf_config, "quantization_config", None):
        method = hf_config.quantization_config.get("quant_method", "?") if isinstance(
            hf_config.quantization_config, dict) else "?"
        raise _refuse("quantization_config.quant_method", method, "quantized checkpoints are not trained; "
                      "start from the model's bf16/fp32 weights")
