"""A LoRA adapter as PEFT saves one (`adapter_model.safetensors` + `adapter_config.json`), from a published
adapter's manifest (its tensor-parallel shards concatenated): what `peft.PeftModel.from_pretrained(base, dir)`
and vLLM's LoRA loader read."""
from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import torch

from .convert.common import HFTensor
from .manifest import ADAPTER_SUFFIXES, Manifest

ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


def adapter_config(*, rank: int, alpha: float, dropout: float, target_modules: list[str],
                   base_model: str) -> dict[str, Any]:
    """PEFT's LoraConfig fields of a tide adapter (plain LoRA: no bias, no rsLoRA, no DoRA, every layer)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
            "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model}


def targets_of(names: list[str]) -> list[str]:
    """The projections (PEFT target names) that adapter tensor names cover."""
    return sorted({n.removesuffix(ADAPTER_SUFFIXES[0]).removesuffix(ADAPTER_SUFFIXES[1]).rsplit(".", 1)[1]
                   for n in names})


def write_peft_adapter(manifest: Manifest, out_dir: str | Path, config: dict[str, Any]) -> Path:
    """`out_dir` as a PEFT adapter directory holding the manifest's adapter, whole; written under a temporary
    name and renamed when complete. Raises ResliceError when a tensor-parallel shard is missing."""
    from .reslice import merged_tensors

    return write_peft_dir(merged_tensors(manifest), out_dir, config, source=manifest.directory)


def merge_records(records: Iterable[HFTensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from the ranks' records of an adapter (the trainer's `adapter_tensors`): tensor-parallel
    shards concatenated along their split, in rank order. Raises ResliceError when a shard is missing."""
    from .reslice import merge_shards

    parts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    splits: dict[str, tuple[int | None, int]] = {}
    for r in records:
        parts[r.name][r.tp_rank] = r.value()
        splits[r.name] = (r.tp_dim, r.tp_size)
    return merge_shards(dict(sorted(parts.items())), splits, "the trainer's adapter")


def write_peft_dir(tensors: dict[str, torch.Tensor], out_dir: str | Path, config: dict[str, Any],
                   source: str = "the trainer") -> Path:
    """`out_dir` as a PEFT adapter directory of these whole adapter tensors (PEFT names)."""
    from safetensors.torch import save_file

    bad = sorted(n for n in tensors if not n.endswith(ADAPTER_SUFFIXES))
    if bad or not tensors:
        raise ValueError(f"{source}: not a LoRA adapter ({bad[:3] or 'no tensors'})")
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(config | {"target_modules": targets_of(list(tensors))}, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
