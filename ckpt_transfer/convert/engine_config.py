"""What the rollout engines (vLLM 0.32) need of a model's config.json to compute what transformers (5.19) computes.

vLLM builds these families from transformers' own config classes, so a field the class defines has one default in
both. A field the class does not define is another matter: transformers' model code may hard-code what vLLM's
reads from the config with a default of its own, and a config.json saved by transformers (`save_pretrained`, e.g.
after fine-tuning) does not hold it. Read in vllm/model_executor/models/<family>.py and transformers'
models/<family>/configuration_ and modeling_<family>.py:

- deepseek_v3: DeepseekV3Config has no `topk_method` and no `scoring_func`; DeepseekV3TopkRouter always scores
  with a sigmoid and chooses with `e_score_correction_bias` added (DeepSeek's noaux_tc). vLLM's DeepseekV2MoE
  creates the bias only for `topk_method == "noaux_tc"` (without it the checkpoint's bias is an unknown weight:
  the engine dies at start with KeyError 'layers.1.mlp.gate.e_score_correction_bias') and scores with
  `getattr(config, "scoring_func", "softmax")`.
- gpt_oss: vLLM's GptOssAttention reads `rope_parameters["beta_fast"]` and `["beta_slow"]` without a default
  (KeyError at start); transformers' yarn takes 32 and 1 where they are absent.

Such fields are added where absent (`engine_fields`): into the config.json of every published iteration
(ckpt_transfer.writer.copy_aux_files, so an exported directory serves right in any vLLM too) and, for a directory
tide does not write (the run's `model.path`, which engines start on), as the engine's `hf_overrides`
(rollout/engine_model.py). What vLLM cannot compute as transformers does is refused by name before anything starts
(`engine_problems`, part of convert.check_supported).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .support import Refusal, rope_parameters

# transformers' yarn defaults (modeling_rope_utils._compute_yarn_parameters: `get("beta_fast") or 32`)
_YARN_BETAS = (("beta_fast", 32.0), ("beta_slow", 1.0))
_DEEPSEEK_ROUTING = (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"))
GPT_OSS_SWIGLU_LIMIT = 7.0  # vLLM's swigluoai kernels clamp at 7.0, whatever the config says


def engine_fields(hf_config: Any) -> dict[str, Any]:
    """The fields, absent from the config, that vLLM needs to compute what transformers computes. A dict value is
    merged into the config's dict of that name (rope_parameters)."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "deepseek_v3":
        return {f: v for f, v in _DEEPSEEK_ROUTING if getattr(hf_config, f, None) is None}
    if kind == "gpt_oss":
        rope = rope_parameters(hf_config)
        missing = {k: v for k, v in _YARN_BETAS if not rope.get(k)} if rope["rope_type"] == "yarn" else {}
        return {"rope_parameters": missing} if missing else {}
    return {}


def engine_overrides(hf_config: Any) -> dict[str, Any]:
    """`engine_fields` as vLLM's `hf_overrides`, which set a field whole: dict fields merged into the config's."""
    return {k: {**rope_parameters(hf_config), **v} if isinstance(v, dict) else v
            for k, v in engine_fields(hf_config).items()}


def complete_config_json(raw: dict, hf_config: Any) -> dict:
    """config.json's contents `raw` (read by transformers as `hf_config`) with `engine_fields` added. A rope field
    goes into the rope dicts the file has (`rope_parameters` as transformers 5 saves it, `rope_scaling` as
    released configs hold it)."""
    out = dict(raw)
    for key, value in engine_fields(hf_config).items():
        if not isinstance(value, dict):
            out[key] = value
            continue
        holders = [k for k in ("rope_parameters", "rope_scaling") if isinstance(out.get(k), dict)]
        for k in holders:
            out[k] = {**out[k], **value}
        if not holders:
            out[key] = {**rope_parameters(hf_config), **value}
    return out


def engine_problems(hf_config: Any) -> Iterator[Refusal]:
    """The fields that vLLM 0.32 computes otherwise than transformers (or cannot load), of fields the trainer itself
    supports."""
    kind = getattr(hf_config, "model_type", None)
    if kind in ("deepseek_v3", "gpt_oss") and getattr(hf_config, "tie_word_embeddings", False):
        yield Refusal("tie_word_embeddings", True, f"vLLM's {kind} model never ties its lm_head to the embeddings "
                      "as transformers does: it serves the checkpoint, which holds no lm_head.weight, with an "
                      "lm_head it never loads")
    if kind == "qwen2":
        head_dim = getattr(hf_config, "head_dim", None)
        if head_dim and head_dim != hf_config.hidden_size // hf_config.num_attention_heads:
            yield Refusal("head_dim", head_dim, "vLLM's Qwen2 model takes hidden_size / num_attention_heads "
                          f"({hf_config.hidden_size // hf_config.num_attention_heads}) where transformers reads "
                          "head_dim")
    if kind == "deepseek_v3":
        yield from _deepseek_yarn_problems(hf_config)
    if kind == "gpt_oss":
        yield from _gpt_oss_problems(hf_config)


def _deepseek_yarn_problems(hf_config: Any) -> Iterator[Refusal]:
    rope = rope_parameters(hf_config)
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers scales cos and sin by mscale(f, mscale) / mscale(f, mscale_all_dim) only when both are set, else
    # by mscale(f, 1); vLLM's deepseek_yarn by the ratio always, with mscale 1 and mscale_all_dim 0 by default
    if rope["rope_type"] == "yarn" and mscale is not None and float(mscale) != 1.0 and not all_dim:
        yield Refusal("rope_parameters.mscale", mscale, "without mscale_all_dim transformers ignores it and vLLM "
                      "scales cos and sin by it")


def _gpt_oss_problems(hf_config: Any) -> Iterator[Refusal]:
    limit = float(getattr(hf_config, "swiglu_limit", GPT_OSS_SWIGLU_LIMIT))
    if limit != GPT_OSS_SWIGLU_LIMIT:
        yield Refusal("swiglu_limit", limit, f"vLLM's gpt-oss experts clamp at {GPT_OSS_SWIGLU_LIMIT} whatever the "
                      "config says")
    rope = rope_parameters(hf_config)
    if rope["rope_type"] != "yarn":
        yield Refusal("rope_parameters.rope_type", rope["rope_type"], "vLLM's gpt-oss model always rotates with "
                      "yarn (its factor, original_max_position_embeddings and betas)")
    if rope.get("attention_factor") is not None or (rope.get("mscale") and rope.get("mscale_all_dim")):
        field = "attention_factor" if rope.get("attention_factor") is not None else "mscale"
        yield Refusal(f"rope_parameters.{field}", rope[field], "vLLM's gpt-oss model takes yarn's attention "
                      "factor from its factor alone")
    # vLLM: a window on every even layer (layer_idx % 2 == 0), none on odd ones; transformers: per layer_types
    window = getattr(hf_config, "sliding_window", None)
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers)
    served = ["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(len(types))]
    if types != served:
        yield Refusal("layer_types", types, f"vLLM's gpt-oss model puts {'the window' if window else 'no window'} "
                      f"on every even layer ({served}) whatever layer_types says")
