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
(rollout/engine_model.py).
"""
from __future__ import annotations

from typing import Any

from .support import rope_parameters

# transformers' yarn defaults (modeling_rope_utils._compute_yarn_parameters: `get("beta_fast") or 32`)
_YARN_BETAS = (("beta_fast", 32.0), ("beta_slow", 1.0))
_DEEPSEEK_ROUTING = (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"))


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
