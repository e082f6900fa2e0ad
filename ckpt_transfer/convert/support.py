"""What tide's trainer computes of a Hugging Face architecture, checked before anything starts.

A config.json field that changes the model's computation and that the Megatron model would not reproduce is
refused by name (the run exits 2), instead of training a different function than the one vLLM samples from
and failing later at the log-prob gap check with a message about log-probs. The checks are per field, not per
model: a field at its neutral value (a null sliding window, a softcap of None, a rope scaling factor of 1) is
accepted. Every refused field is reported at once (`Refusal`s gathered by `refuse_all`), each under the name the
model's config.json gives it: the checks name rope fields as transformers 5 does (`rope_parameters.<key>`), and
`spelled` renames them after the file (`rope_scaling.<key>` as released Llama and Qwen2 configs hold them,
`rope_scaling.type`, a top-level `rope_theta`).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .common import ConversionError


class UnsupportedModelError(ConversionError):
    """The model's config asks for computation the trainer does not implement."""


@dataclass(frozen=True)
class Refusal:
    """One config.json field the trainer or the engines would not compute as transformers does."""

    field: str  # a rope field as transformers 5 names it: rope_parameters.<key>
    value: Any
    why: str

    def __str__(self) -> str:
        return f"config.json field {self.field} = {self.value!r}: {self.why}"


Check = Callable[[Any], Iterable[Refusal]]


def declared_fields(hf_config: Any) -> Mapping[str, Any]:
    """The config's fields as its config.json spells them: the file transformers read it from (`_name_or_path`),
    else the object's own attributes (a config built in code, where transformers 5 holds rope_parameters)."""
    path = getattr(hf_config, "_name_or_path", None)
    if isinstance(path, str) and path and (Path(path) / "config.json").is_file():
        return json.loads((Path(path) / "config.json").read_text())
    to_dict = getattr(hf_config, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(getattr(hf_config, "__dict__", {}))


def spelled(field: str, declared: Mapping[str, Any]) -> str:
    """`field` (rope fields named rope_parameters.<key>) as the file `declared` names it."""
    prefix, dot, key = field.partition(".")
    if prefix != "rope_parameters" or not dot:
        return field
    holder = next((k for k in ("rope_parameters", "rope_scaling") if isinstance(declared.get(k), dict)), None)
    params = declared.get(holder, {}) if holder else {}
    if key == "rope_theta" and key not in params and key in declared:
        return key
    if key == "rope_type" and key not in params and "type" in params:
        key = "type"
    return f"{holder or 'rope_parameters'}.{key}"


def gather(hf_config: Any, checks: Iterable[Check]) -> list[Refusal | UnsupportedModelError]:
    """Every check's refusals; a check that cannot go on (a config it cannot read further) ends with its error."""
    found: list[Refusal | UnsupportedModelError] = []
    for check in checks:
        try:
            found.extend(check(hf_config))
        except UnsupportedModelError as e:
            found.append(e)
    return found


def refuse_all(hf_config: Any, checks: Iterable[Check]) -> None:
    """Raise UnsupportedModelError listing every field `checks` refuse, each as the model's config.json names it
    (one field: its line alone)."""
    declared = declared_fields(hf_config)
    found: list[Refusal | UnsupportedModelError] = []
    for f in gather(hf_config, checks):
        same = next((i for i, g in enumerate(found) if isinstance(f, Refusal) and isinstance(g, Refusal)
                     and g.field == spelled(f.field, declared) and g.value == f.value), None)
        if same is not None:  # the trainer's reason and the engines' for one field: one line
            found[same] = replace(found[same], why=f"{found[same].why}; {f.why}")
        else:
            found.append(replace(f, field=spelled(f.field, declared)) if isinstance(f, Refusal) else f)
    if len(found) == 1:
        raise UnsupportedModelError(str(found[0]))
    if found:
        raise UnsupportedModelError(f"{len(found)} fields of the model's config.json ask for computation tide does "
                                    f"not implement:\n" + "\n".join(f"  {f}" for f in found))


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


def common_problems(hf_config: Any, rope_types: tuple[str, ...] = ROPE_TYPES_BY_FREQUENCY) -> Iterator[Refusal]:
    """Fields any decoder family may carry that the trainer does not compute."""
    rope = rope_parameters(hf_config)
    if rope["rope_type"] not in rope_types:
        yield Refusal("rope_parameters.rope_type", rope["rope_type"], f"this rope type is not implemented for "
                      f"{hf_config.model_type} (supported: {', '.join(rope_types)})")
    if float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        yield Refusal("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None),
                      "rotary embeddings on part of each head are not implemented")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        yield Refusal("hidden_act", act, "only silu (SwiGLU) MLPs are implemented")
    if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
        yield Refusal("sliding_window", hf_config.sliding_window, "sliding-window attention is not implemented "
                      "(use_sliding_window is true)")
    elif hf_config.model_type == "mistral" and getattr(hf_config, "sliding_window", None):
        window = hf_config.sliding_window
        if window < getattr(hf_config, "max_position_embeddings", window):
            yield Refusal("sliding_window", window, "sliding-window attention is not implemented (set it to null "
                          "or to max_position_embeddings if the model was trained without it)")
    layer_types = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
    if layer_types - {"full_attention"}:
        yield Refusal("layer_types", sorted(layer_types), "only full attention layers are implemented")
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "attention_sink",
                  "use_qk_l2_norm", "query_pre_attn_scalar"):
        value = getattr(hf_config, field, None)
        if value not in (None, False, 0, 1, 1.0):
            yield Refusal(field, value, "not implemented by the trainer")
    if getattr(hf_config, "mlp_bias", False):
        yield Refusal("mlp_bias", True, "MLP biases are not implemented")
    if getattr(hf_config, "quantization_config", None):
        method = hf_config.quantization_config.get("quant_method", "?") if isinstance(
            hf_config.quantization_config, dict) else "?"
        yield Refusal("quantization_config.quant_method", method, "quantized checkpoints are not trained; "
                      "start from the model's bf16/fp32 weights")
