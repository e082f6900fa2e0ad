"""A rank's part of a run's checkpoint, in Megatron's distributed format (CKPT/megatron, beside CKPT/layout.json):
the model, the optimizer once it holds state, the frozen reference and the RNG streams; loaded into the same
layout, or resharded into another where megatron-core can (dense models)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank


def _write_results_in_process() -> None:
    """Megatron's synchronous torch_dist save writes with threads of this process, yet hands their results over a
    multiprocessing Manager queue that its first save creates by spawning a server process (3.5 s, 275 MB resident
    for the life of the rank, measured on a tiny model; 5-11 s for a rank under Ray). A thread-safe queue of this
    process carries them as well. Only an asynchronous save, which tide does not use, writes from another process."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _layout_record(rank: MegatronRank) -> dict:
    p = rank.spec.trainer.parallel
    return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "moe": bool(rank.config.num_moe_experts)}


def _optimizer_has_state(rank: MegatronRank) -> bool:
    """Whether Adam holds moments yet: torch creates them at a parameter's first step, so right after a reset
    (the warm start's end) and until the first RL step that takes one there are none."""
    chained = getattr(rank.optimizer, "chained_optimizers", [rank.optimizer])
    return any(len(state) > 0 for o in chained for state in o.optimizer.state.values())


def _optimizer_metadata(rank: MegatronRank) -> dict:
    """How Megatron lays out a distributed optimizer's state in the checkpoint: `dp_reshardable` (each rank's
    buffers as they are; loads into another data-parallel degree only). megatron-core 0.19's default
    (fully_sharded_model_space) refuses to save ("ShardedTensor.flattened_range is not supported"), and its
    `fully_reshardable` fails to load into torch's Adam (KeyError 'step': it skips the per-parameter step that
    torch's Adam keeps)."""
    if not rank.spec.trainer.uses_distributed_optimizer:
        return {}
    return {"distrib_optim_sharding_type": "dp_reshardable"}


def _restore_adam_steps(rank: MegatronRank) -> None:
    """megatron-core 0.19's distributed optimizer over torch's Adam (no Transformer Engine or apex) saves Adam's step
    count in its parameter groups; loading, it hands every parameter's state one shared `step` tensor, which the
    dp_reshardable parameter state then overwrites with the live optimizer's (not the checkpoint's) count. Adam's
    bias corrections then run with the wrong step and a resumed run diverges (measured on a tiny model: the first
    loss after a resume off by 8e-5). Each state gets its own tensor of its group's saved count."""
    for optimizer in getattr(rank.optimizer, "chained_optimizers", [rank.optimizer]):
        inner = optimizer.optimizer
        for group in inner.param_groups:
            if "step" not in group:  # a plain (non-distributed) optimizer: torch's own state, loaded as saved
                continue
            for p in group["params"]:
                state = inner.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _sharded_state(rank: MegatronRank, is_loading: bool, with_rng: bool = True, with_optimizer: bool = True) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ps = rank.ps
    model_sd = _model_state(rank)
    rng = {"cpu": torch.get_rng_state()}
    if rank.spec.trainer.device == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    rng["tracker"] = get_cuda_rng_tracker().get_states()
    pos = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
           ps.get_expert_model_parallel_rank())
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_expert_model_parallel_world_size())
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = rank.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                               metadata=_optimizer_metadata(rank))
    if rank.reference is not None and rank.spec.trainer.lora is None:  # a LoRA run's reference is its base
        state["reference"] = rank.reference.sharded_state_dict(prefix="reference.")
    if with_rng:
        # ranks that share (pp, tp, ep) coordinates hold copies: they form the expert-data-parallel group
        state["rng"] = ShardedObject("rng_state", rng, shape, pos, replica_id=ps.get_expert_data_parallel_rank())
    return state


def _model_state(rank: MegatronRank) -> dict:
    """The policy's sharded state: with trainer.lora its adapters only (the base is the model directory, recorded
    by digest in layout.json)."""
    from trainer.megatron.lora import is_adapter_parameter

    state = rank.module.sharded_state_dict()
    return {k: v for k, v in state.items() if is_adapter_parameter(k)} if rank.spec.trainer.lora else state


def _load_model_state(rank: MegatronRank, state: dict) -> None:
    if rank.spec.trainer.lora is None:
        rank.module.load_state_dict(state)
        return
    from trainer.megatron.lora import is_adapter_parameter

    result = rank.module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if is_adapter_parameter(k)]
    if missing or result.unexpected_keys:
        raise ValueError(f"the checkpoint's adapters do not match trainer.lora: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")


_BASE_DIGESTS: dict[tuple, str] = {}


def base_digest(hf_dir: str) -> str:
    """sha256 over the base model's config and weight files (names and bytes): what a LoRA checkpoint was trained
    on. Computed once per process for unchanged files."""
    files = sorted([*Path(hf_dir).glob("*.safetensors"), Path(hf_dir) / "config.json"])
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _BASE_DIGESTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while block := fh.read(1 << 24):
                    h.update(block)
        _BASE_DIGESTS[key] = h.hexdigest()
    return _BASE_DIGESTS[key]


def _lora_record(rank: MegatronRank) -> dict | None:
    lora = rank.spec.trainer.lora
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": sorted(lora.target_modules),
            "base": rank.spec.hf_dir, "base_digest": base_digest(rank.spec.hf_dir)}


def _check_lora(rank: MegatronRank, ckpt_dir: str, saved: dict | None) -> None:
    """A LoRA checkpoint resumes onto the base it was trained on, with the same adapters."""
    mine = _lora_record(rank)
    if (saved is None) != (mine is None):
        raise ValueError(f"{ckpt_dir} was saved {'with' if saved else 'without'} trainer.lora; the run has it "
                         f"{'off' if saved else 'on'}: resume with the same setting")
    if saved is None:
        return
    if saved["base_digest"] != mine["base_digest"]:
        raise ValueError(f"{ckpt_dir} holds adapters trained on the base {saved['base']} (sha256 "
                         f"{saved['base_digest'][:12]}); the model directory {mine['base']} differs (sha256 "
                         f"{mine['base_digest'][:12]}): resume on the base it was trained on")
    shape = {k: saved[k] for k in ("rank", "alpha", "target_modules")}
    if shape != {k: mine[k] for k in shape}:
        raise ValueError(f"{ckpt_dir} holds adapters {shape}; trainer.lora asks for "
                         f"{ {k: mine[k] for k in shape} }: resume with the same rank, alpha and target_modules")


def save_checkpoint(rank: MegatronRank, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    _write_results_in_process()
    target = Path(ckpt_dir) / "megatron"
    # A checkpoint taken before the optimizer's first step holds no optimizer state (Megatron writes none, and
    # loading would expect moments): recorded, so that a resume keeps its fresh optimizer. Every rank steps
    # together, so they all agree.
    with_optimizer = _optimizer_has_state(rank)
    if rank.rank == 0:
        target.mkdir(parents=True, exist_ok=True)
        (Path(ckpt_dir) / "layout.json").write_text(json.dumps(
            _layout_record(rank) | {"optimizer_state": with_optimizer,
                                    "distributed_optimizer": rank.spec.trainer.uses_distributed_optimizer,
                                    "lora": _lora_record(rank)}))
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state(rank, is_loading=False, with_optimizer=with_optimizer), str(target))
    torch.distributed.barrier()


def load_checkpoint(rank: MegatronRank, ckpt_dir: str) -> None:
    """Load model, optimizer and RNG. A dense checkpoint may be loaded into another TP/PP layout
    (Megatron's distributed checkpoint reshards; RNG streams, which are per rank, are then re-seeded)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from trainer.megatron.model import LayoutError

    p = rank.spec.trainer.parallel
    saved_file = Path(ckpt_dir) / "layout.json"
    saved = json.loads(saved_file.read_text()) if saved_file.exists() else _layout_record(rank)
    with_optimizer = saved.pop("optimizer_state", True)  # False: saved before any step (see save_checkpoint)
    _check_lora(rank, ckpt_dir, saved.pop("lora", None))
    distributed = rank.spec.trainer.uses_distributed_optimizer
    saved_distributed = saved.pop("distributed_optimizer", False)
    if with_optimizer and saved_distributed != distributed:
        raise ValueError(f"{ckpt_dir} holds the optimizer state of {'a plain' if distributed else 'a distributed'} "
                         f"optimizer: resume with trainer.distributed_optimizer {not distributed} (Megatron's two "
                         f"optimizers lay their state out differently)")
    same_layout = saved == _layout_record(rank)
    if not same_layout and with_optimizer and distributed:
        raise LayoutError(
            f"{ckpt_dir} was saved with tp={saved['tp']} pp={saved['pp']} ep={saved['ep']}: the distributed "
            f"optimizer's state (Megatron's dp_reshardable format) loads into another data-parallel degree only; "
            f"resume with the saved trainer.parallel tp, pp and ep")
    if not same_layout and saved.get("moe"):
        raise LayoutError(
            f"{ckpt_dir} holds a mixture-of-experts checkpoint saved with tp={saved['tp']} pp={saved['pp']} "
            f"ep={saved['ep']}; megatron-core 0.19.2 cannot reshard its optimizer state into tp={p.tp} "
            f"pp={p.pp} ep={p.ep}: resume with the saved trainer.parallel layout")
    state = dist_checkpointing.load(
        _sharded_state(rank, is_loading=True, with_rng=same_layout, with_optimizer=with_optimizer),
        str(Path(ckpt_dir) / "megatron"))
    _load_model_state(rank, state["model"])
    if with_optimizer:
        # megatron-core 0.19's distributed optimizer copies dp_reshardable state into its main parameters
        # outside no_grad: in float32 those are views of the model's parameters, which autograd refuses
        with torch.no_grad():
            rank.optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(rank)
    else:
        rank.reset_optimizer()  # as it was when saved: no moments, step 0
    if rank.reference is not None and rank.spec.trainer.lora is None:
        rank.reference.load_state_dict({k.removeprefix("reference."): v for k, v in state["reference"].items()})
    if not same_layout:
        return
    rng = state["rng"]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and rank.spec.trainer.device == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])


def load_model(rank: MegatronRank, ckpt_dir: str) -> None:
    """The policy's parameters only (no optimizer, RNG or reference), resharded from whatever layout saved
    them into this rank's: what `tide export` needs."""
    from megatron.core import dist_checkpointing

    saved_file = Path(ckpt_dir) / "layout.json"
    if saved_file.exists():
        _check_lora(rank, ckpt_dir, json.loads(saved_file.read_text()).get("lora"))
    state = dist_checkpointing.load({"model": _model_state(rank)}, str(Path(ckpt_dir) / "megatron"))
    _load_model_state(rank, state["model"])


def parameter_digest(rank: MegatronRank) -> str:
    """sha256 over this rank's parameters (names and bytes): equal digests mean equal weights."""
    h = hashlib.sha256()
    for name, p in sorted(rank.module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
