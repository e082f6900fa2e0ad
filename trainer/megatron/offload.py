"""A rank's device memory handed over between phases (the hybrid deployment, `placement.mode: colocated` on CUDA:
the engines use the GPUs while the trainer waits): `offload` copies the rank's parameters (the policy's and its
frozen copies'), the optimizer's fp32 main parameters and Adam moments to host memory (pinned on CUDA) and
releases their storage; its gradients are released without a copy. `onload` takes the storage back and copies
everything in again, bit for bit; the gradients come back as zeros (every optimizer step zeroes them before its
backward pass: train_step._optimizer_step).

The mechanism works on storages, not tensors: each storage is resized to 0 bytes and back in place, the way
megatron-core's DistributedDataParallel.offload_grad_buffers and its _ParamAndGradBuffer.offload_to_cpu release
the grad and param buffers (and veRL's and slime's offload the parameters), so that every view into it stays
valid: parameters inside the distributed optimizer's param buffer, `main_grad`, the main parameters' `.grad`,
the optimizer's shard views. megatron-core's MegatronOptimizer.offload_to_cpu is not used: it replaces tensors
(`p.data = p.data.cpu()`), skips whatever is not on a CUDA device (so on CPU it releases nothing) and leaves the
model alone. On CPU the copy is a copy within host memory: what the test checks there is that the rank holds no
parameter, gradient or optimizer storage while offloaded, and that it resumes bit for bit."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

import torch

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank

F = TypeVar("F", bound=Callable)


class OffloadedError(RuntimeError):
    """A call that needs the rank's weights or optimizer state, made while they are offloaded."""


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 [nbytes]; None: a gradient, released without a copy and zeroed on onload


@dataclass
class Offloaded:
    """What `offload` released, kept on the rank until `onload`."""

    held: list[_Held] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(h.nbytes for h in self.held if h.host is not None)

    @property
    def released_bytes(self) -> int:
        return sum(h.nbytes for h in self.held)


def is_offloaded(rank: MegatronRank) -> bool:
    return getattr(rank, "_offloaded", None) is not None


def resident(method: F) -> F:
    """A rank method that needs the weights or optimizer state: refused by name while they are offloaded."""

    @functools.wraps(method)
    def guarded(rank, *args, **kwargs):
        if is_offloaded(rank):
            raise OffloadedError(f"{method.__name__}: this trainer rank's weights and optimizer state are offloaded "
                                 f"to host memory (offload()); call onload() first")
        return method(rank, *args, **kwargs)

    return guarded  # type: ignore[return-value]


def offload(rank: MegatronRank) -> dict[str, float]:
    """Copy the rank's parameters and optimizer state to host memory and release their storage, and release its
    gradients. Returns {"offload_bytes": copied, "released_bytes": released in all, "offload_s": seconds}; a rank
    already offloaded returns zeros."""
    start = time.perf_counter()
    if is_offloaded(rank):
        return {"offload_bytes": 0, "released_bytes": 0, "offload_s": 0.0}
    cuda = rank.spec.trainer.device == "cuda"
    pool: dict[int, torch.Tensor] = getattr(rank, "_offload_pool", {})
    kept, grads = storages(rank)
    done = Offloaded()
    for storage in kept:
        nbytes = storage.nbytes()
        host = pool.get(storage._cdata)
        if host is None or host.numel() != nbytes:
            # pinned: a page-locked buffer copies at the link's speed, asynchronously (kept for the next offload,
            # as megatron-core's param buffer keeps its param_data_cpu: pinning is slow)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        host.copy_(_bytes(storage), non_blocking=cuda)
        done.held.append(_Held(storage, nbytes, host))
        if not cuda:  # copied already: released at once, so that host memory never holds the state twice
            _resize(storage, 0)
    for storage in grads:
        done.held.append(_Held(storage, storage.nbytes(), None))
    if cuda:
        torch.cuda.synchronize()  # the copies have landed before their source is released
    for h in done.held:
        if h.storage.nbytes():
            _resize(h.storage, 0)
    if cuda:
        torch.cuda.empty_cache()  # back to the driver, for the engines on the same GPU
        rank._offload_pool = {h.storage._cdata: h.host for h in done.held if h.host is not None}
    rank._offloaded = done
    return {"offload_bytes": done.host_bytes, "released_bytes": done.released_bytes,
            "offload_s": time.perf_counter() - start}


def onload(rank: MegatronRank) -> dict[str, float]:
    """Take back what `offload` released: the parameters and optimizer state as they were, the gradients
    zeroed. Returns {"onload_bytes": copied, "onload_s": seconds}; a rank not offloaded returns zeros."""
    start = time.perf_counter()
    done: Offloaded | None = getattr(rank, "_offloaded", None)
    if done is None:
        return {"onload_bytes": 0, "onload_s": 0.0}
    cuda = rank.spec.trainer.device == "cuda"
    for h in done.held:
        _resize(h.storage, h.nbytes)
        if h.host is None:
            _bytes(h.storage).zero_()
        else:
            _bytes(h.storage).copy_(h.host, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    rank._offloaded = None  # on CPU the host copies go with it; on CUDA the pinned buffers stay in the pool
    return {"onload_bytes": done.host_bytes, "onload_s": time.perf_counter() - start}


def storages(rank: MegatronRank) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
    """The distinct storages on the rank's device that `offload` releases: (kept: the parameters of the policy
    and its frozen copies, the DDP param buffers, the optimizer's main parameters and state; gradients: the DDP
    grad buffers and every `.grad` / `main_grad`), each once, in a fixed order. A storage that holds both a
    parameter and a gradient is kept."""
    device = torch.device("cuda" if rank.spec.trainer.device == "cuda" else "cpu")
    seen: set[int] = set()

    def distinct(tensors: Iterator[torch.Tensor]) -> list[torch.UntypedStorage]:
        out = []
        for t in tensors:
            if t is None or t.device.type != device.type:
                continue
            s = t.untyped_storage()
            if s.nbytes() and s._cdata not in seen:
                seen.add(s._cdata)
                out.append(s)
        return out

    return distinct(_kept_tensors(rank)), distinct(_grad_tensors(rank))


def _kept_tensors(rank: MegatronRank) -> Iterator[torch.Tensor]:
    for module in (rank.module, rank.reference, rank.behaviour):
        if module is not None:
            yield from module.parameters()
            yield from module.buffers()
    for buffer in _ddp_buffers(rank):
        yield buffer.param_data
    for inner in _torch_optimizers(rank):
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


def _grad_tensors(rank: MegatronRank) -> Iterator[torch.Tensor]:
    for buffer in _ddp_buffers(rank):
        yield buffer.grad_data
        yield from getattr(buffer, "extra_main_grads", [])
    params = list(rank.module.parameters())
    params += [p for inner in _torch_optimizers(rank) for group in inner.param_groups for p in group["params"]]
    for p in params:
        yield p.grad
        yield getattr(p, "main_grad", None)


def _ddp_buffers(rank: MegatronRank) -> list:
    return list(rank.model.buffers) + list(rank.model.expert_parallel_buffers)


def _torch_optimizers(rank: MegatronRank) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (a ChainedOptimizer's parts; a rank without parameters of a kind has
    a stub without one)."""
    chained = getattr(rank.optimizer, "chained_optimizers", [rank.optimizer])
    return [o.optimizer for o in chained if getattr(o, "optimizer", None) is not None]


def _resize(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Resize in place (0: release), keeping the storage object that every view holds. A CPU storage that numpy has
    viewed is fixed-size (torch's tensor_to_numpy marks it so, that numpy never points into freed memory; the
    safetensors writer and parameter_digest view parameters through numpy): its memory is swapped with a new
    storage of the size instead, and the old memory leaves with that one."""
    if storage.resizable():
        storage.resize_(nbytes)
    else:
        storage._swap_data_ptr_(torch.UntypedStorage(nbytes, device=storage.device))


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as one uint8 tensor (a view: writing it writes the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
