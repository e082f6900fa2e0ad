"""The rollout engine's routing recorder inside vLLM's model workers (rollout/routing_capture.py records, this
module plugs it in). Imported by vLLM in each worker process, through the worker extension the engine names
(LLM(worker_extension_cls=routing_capture.WORKER_EXTENSION)), before the worker loads its model.

Two doors into vLLM, both its own extension points:
- a model loader (load_format routing_capture.LOAD_FORMAT, vLLM's default loader otherwise) binds a recorder to
  the model's routers right after loading, before a compiled engine traces the model (torch.compile, CUDA
  graphs): the recorder's buffer writes are part of the traced forward, as vLLM's own capture's are;
- RoutingCaptureExtension's methods, which the engine calls by name through collective_rpc in every engine layout
  (a function object would have to be pickled to an engine core in its own process).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    _get_routed_experts_shape,
    bind_routed_experts_capturer,
)
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .routing_capture import LOAD_FORMAT, RoutingRecorder, to_wire


@register_model_loader(LOAD_FORMAT)
class RecordingModelLoader(DefaultModelLoader):
    """vLLM's default loader, which also binds a RoutingRecorder to a mixture-of-experts model's routers."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(dataclasses.replace(load_config, load_format="auto"))

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = super().load_model(vllm_config, model_config, prefix)
        if model_config.is_moe:
            num_layers, _, top_k = _get_routed_experts_shape(vllm_config)
            recorder = RoutingRecorder(vllm_config.device_config.device, num_layers, top_k,
                                       vllm_config.scheduler_config.max_num_batched_tokens)
            bind_routed_experts_capturer(model, recorder)
            model.tide_routing_recorder = recorder
        return model


def install(worker: Any) -> tuple[int, int] | None:
    """Start reading the recorder bound at load after each of the runner's steps. Returns (num_hidden_layers,
    top_k) for a mixture-of-experts model, None for a dense one."""
    runner = worker.model_runner
    if not runner.vllm_config.model_config.is_moe:
        return None
    if not hasattr(runner, "input_batch"):
        raise RuntimeError(f"recording the routed experts (rollout.record_routing) needs vLLM's V1 model runner, "
                           f"whose batch layout the recorder reads; this engine runs {type(runner).__name__} "
                           f"(VLLM_USE_V2_MODEL_RUNNER={os.environ.get('VLLM_USE_V2_MODEL_RUNNER')!r}): set it to 0 "
                           f"or rollout.record_routing false")
    recorder = getattr(runner.get_model(), "tide_routing_recorder", None)
    if recorder is None:
        raise RuntimeError(f"no routing recorder on the engine's model: it was not loaded with load_format "
                           f"{LOAD_FORMAT!r} ({runner.vllm_config.load_config.load_format!r})")
    if recorder.runner is None:
        recorder.runner = runner
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            out = execute(scheduler_output, *args, **kwargs)
            recorder.commit(scheduler_output)
            return out

        runner.execute_model = execute_model
    return recorder.num_layers, recorder.top_k


def drain(worker: Any) -> dict[str, np.ndarray]:
    """Every request's record so far, forgotten here. Tensor-parallel ranks route every token alike (the router is
    replicated and sees the whole hidden state), so the first rank's records are returned and the others' only
    dropped."""
    recorder = getattr(worker.model_runner.get_model(), "tide_routing_recorder", None)
    if recorder is None or recorder.runner is None:
        return {}
    records = recorder.drain()
    return records if worker.rank == 0 else {}


class RoutingCaptureExtension:
    """Mixed into vLLM's worker class: the recorder's calls as worker methods, for collective_rpc by name."""

    def tide_record_routing(self) -> tuple[int, int] | None:
        return install(self)

    def tide_drain_routing(self) -> dict[str, tuple[bytes, list[int]]]:
        return to_wire(drain(self))
