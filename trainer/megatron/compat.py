"""Run megatron-core (0.19.x) on CPU with the gloo backend.

megatron-core assumes CUDA in many places: grad buffers and TP gather buffers are allocated on
`torch.cuda.current_device()`, the optimizer and schedules create tensors with a literal `device="cuda"`,
the RNG tracker saves and restores the CUDA generator, and `clip_grads` asserts `torch.cuda.FloatTensor`.
`enable_cpu_compat()` redirects those to the CPU, process-wide, without editing site-packages. It is only
called when the config says `trainer.device: cpu`; on GPUs nothing here runs and Megatron is untouched.

Every patch is listed in `_PATCHES` with the reason it exists, so that each can be dropped when
megatron-core stops needing it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_enabled = False
_PATCHES: list[tuple[str, str]] = []  # (what, why), for documentation and `describe()`


def _patch(obj: Any, name: str, value: Any, why: str) -> None:
    setattr(obj, name, value)
    _PATCHES.append((f"{getattr(obj, '__name__', obj)}.{name}", why))


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _as_cuda_type_name(name: str) -> str:
    """'torch.BFloat16Tensor' -> 'torch.cuda.BFloat16Tensor': the mixed-precision optimizer picks which
    parameters get an fp32 main copy by comparing `param.type()` with the CUDA names only."""
    return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device="cuda"` (or an int device index) in tensor factories and `.to()`/`.cuda()` calls, and
    reports CPU tensors' `.type()` under their CUDA names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _as_cuda_type_name(func(*args))
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _CpuRngTracker:
    """Stand-in for torch.cuda.get_rng_state/set_rng_state used by Megatron's RNG tracker: the CUDA
    generator's state becomes the CPU generator's, so forked RNG regions (dropout, init) stay reproducible."""

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(state)


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Same contract as megatron's clip_grad_by_total_norm_fp32, without its CUDA tensor-type assert and
    multi_tensor_applier."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(coeff, torch.Tensor):
        coeff = coeff.clamp_max(1.0)
        for g in grads:
            g.mul_(coeff)
    elif coeff < 1.0:
        for g in grads:
            g.mul_(coeff)


def _all_to_all_single_with_list_splits(orig):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return orig(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    return all_to_all_single


def enable_cpu_compat() -> None:
    """Idempotent. Call before building any Megatron object."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    cuda = torch.cuda
    _patch(cuda, "current_device", lambda: "cpu",
           "grad buffers, rotary inv_freq, TP/PP communication buffers are placed on current_device()")
    _patch(cuda, "synchronize", lambda *a, **k: None, "timers and schedules synchronize the CUDA stream")
    _patch(cuda, "current_stream", lambda *a, **k: _NullStream(), "p2p and DDP record on streams")
    _patch(cuda, "Stream", _NullStream, "DDP overlap and checkpointing create side streams")
    _patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext(), "side-stream contexts")
    _patch(cuda, "Event", _NullEvent, "MoE dispatchers and DDP record events on side streams")
    _patch(cuda, "get_rng_state", _CpuRngTracker.get_rng_state, "RNG tracker forks the CUDA generator")
    _patch(cuda, "set_rng_state", _CpuRngTracker.set_rng_state, "RNG tracker restores the CUDA generator")
    _patch(cuda, "manual_seed", torch.manual_seed, "the RNG tracker seeds 'CUDA' between saving and restoring its state")
    _patch(cuda, "memory_allocated", lambda *a, **k: 0, "memory reports")
    _patch(cuda, "max_memory_allocated", lambda *a, **k: 0, "memory reports")
    _patch(cuda, "empty_cache", lambda *a, **k: None, "offload paths")
    _patch(torch.Tensor, "record_stream", lambda self, stream: None, "DDP buffers record their stream")

    from megatron.core.tensor_parallel import random as mrandom

    _patch(mrandom, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(),
           "the RNG tracker reads the CUDA generator through CUDA-only internals")
    _patch(mrandom, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state),
           "the RNG tracker restores the CUDA generator through CUDA-only internals")

    from megatron.core.optimizer import clip_grads, optimizer

    clip = _clip_grad_by_total_norm_cpu
    for mod in (clip_grads, optimizer):  # optimizer.py imported the name: patch both bindings
        _patch(mod, "clip_grad_by_total_norm_fp32", clip, "asserts torch.cuda.FloatTensor, uses multi_tensor_applier")
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    for mod in (tutils, fused_softmax):  # fused_softmax imported the name: patch both bindings
        _patch(mod, "get_default_causal_mask", causal_mask,
               "the attention softmax's causal mask is built with a literal device='cuda' on every forward, the "
               "one such call on the model's forward path (which runs outside the TorchFunctionMode)")

    def sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        # megatron.core.transformer.utils.get_sliding_window_causal_mask on the CPU: True where masked out
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    for mod in (tutils, fused_softmax):
        _patch(mod, "get_sliding_window_causal_mask", sliding_window_mask,
               "sliding-window layers (gpt_oss) build their mask with a literal device='cuda' on every forward")
    import torch.distributed as tdist

    _patch(tdist, "all_to_all_single", _all_to_all_single_with_list_splits(tdist.all_to_all_single),
           "MoE alltoall passes split sizes as CPU tensors; gloo's binding accepts only sequences of ints")
    _CudaToCpu().__enter__()  # process-wide: literal device='cuda' in optimizer, schedules, clip_grads
    _PATCHES.append(("TorchFunctionMode", "rewrites literal device='cuda' to cpu (about 15 us per call); "
                                          "Tensor.type() answers CUDA names (bf16/fp16 optimizer's type checks)"))


def native_torch_steps(optimizer: Any) -> None:
    """Run the step of each torch optimizer under Megatron's `optimizer` (a ChainedOptimizer or one) without the
    device-rewriting mode: torch's Adam names no device but its parameters' own, and its for-loop over parameter
    tensors made ~6% of a tiny model's train step the mode's dispatch (py-spy). Megatron's own step (grad norm,
    clipping, found-inf) keeps the mode: it creates tensors on a literal 'cuda'. A no-op on GPUs."""
    if not _enabled:
        return
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = megatron_optimizer.optimizer
        step = torch_optimizer.step

        def native_step(*args, _step=step, **kwargs):
            with native_torch():
                return _step(*args, **kwargs)

        torch_optimizer.step = native_step


@contextlib.contextmanager
def native_torch() -> Iterator[None]:
    """Suspend the device-rewriting TorchFunctionMode (and any other torch-function override) for code
    that only takes views or copies of existing tensors. The mode's Python dispatch costs about 15 us per
    torch call: 7 ms of a 92 ms publish of the 104M-parameter bench model (459 calls). A no-op on GPUs."""
    if not _enabled:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


class _NullStream:
    def __init__(self, *a, **k) -> None:
        pass

    def wait_stream(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a, **k) -> "_NullEvent":
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _NullEvent:
    """Events recorded on a _NullStream: CPU work is already complete when recorded."""

    def __init__(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *a, **k) -> None:
        pass

    def query(self) -> bool:
        return True


def describe() -> list[tuple[str, str]]:
    return list(_PATCHES)
