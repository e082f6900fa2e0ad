"""Tensor-parallel re-slicing between trainer TP=a and rollout TP=b.

The manifest keeps each TP shard with its (tp_rank, tp_size, tp_dim). A rollout engine either loads whole
tensors (vLLM's loader then slices them for its own TP degree) or takes shards for its TP degree directly;
both come from `reslice`.
"""
from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch

from .manifest import Manifest, ShardRecord, TensorRecord


class ResliceError(ValueError):
    pass


def reslice(shards: Sequence[torch.Tensor], dim: int, target_size: int) -> list[torch.Tensor]:
    """TP shards of one tensor (ordered by tp_rank) -> `target_size` shards along the same dimension."""
    full = shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=dim)
    if full.shape[dim] % target_size:
        raise ResliceError(f"dimension {dim} of size {full.shape[dim]} cannot be split into TP={target_size}")
    return [c.contiguous() for c in full.chunk(target_size, dim=dim)]


def merged_tensors(manifest: Manifest, directory: str | Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the manifest whole (TP shards concatenated), read from `directory`."""
    from safetensors import safe_open

    directory = Path(directory or manifest.directory)
    parts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    meta: dict[str, TensorRecord] = {}
    for shard in manifest.shards:
        with safe_open(str(directory / shard.file), "pt") as f:
            for rec in shard.tensors:
                parts[rec.name][rec.tp_rank] = f.get_tensor(rec.name)
                meta[rec.name] = rec
    return merge_shards(parts, {name: (rec.tp_dim, rec.tp_size) for name, rec in meta.items()}, "the manifest")


def merge_shards(parts: dict[str, dict[int, torch.Tensor]], splits: dict[str, tuple[int | None, int]],
                 source: str) -> dict[str, torch.Tensor]:
    """Whole tensors from their TP shards ({name: {tp_rank: shard}}, split as {name: (tp_dim, tp_size)}; tp_dim
    None: whole already, rank 0's copy), concatenated in rank order; ResliceError names a missing shard."""
    out = {}
    for name, by_rank in parts.items():
        tp_dim, tp_size = splits[name]
        if tp_dim is None:
            out[name] = by_rank[0]
            continue
        missing = sorted(set(range(tp_size)) - set(by_rank))
        if missing:
            raise ResliceError(f"{name}: TP shards {missing} of {tp_size} are missing from {source}")
        out[name] = torch.cat([by_rank[r] for r in range(tp_size)], dim=tp_dim)
    return out


def materialize_whole(manifest: Manifest, out_dir: str | Path) -> Path:
    """An HF directory with whole tensors for a manifest whose tensors are TP-sharded; the manifest's own
    directory when they are already whole. Written to a temporary name and renamed when complete."""
    if manifest.is_whole:
        return Path(manifest.directory)
    from safetensors.torch import save_file

    from .checksum import checksum_file
    from .writer import finalize_manifest, rename_into_place

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = merged_tensors(manifest)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    src = Path(manifest.directory)
    for name in manifest.aux_files + [p.name for p in src.iterdir() if p.name.startswith("tokenizer")]:
        if (src / name).exists():
            shutil.copyfile(src / name, tmp / name)
    dtype = manifest.shards[0].tensors[0].dtype if manifest.shards else "float32"
    whole = Manifest(run=manifest.run, iteration=manifest.iteration, directory=str(tmp),
                     shards=[ShardRecord(file="model.safetensors", node=manifest.shards[0].node if manifest.shards else "",
                                         nbytes=(tmp / "model.safetensors").stat().st_size,
                                         checksum=checksum_file(tmp / "model.safetensors"),
                                         tensors=tuple(TensorRecord(n, dtype, tuple(t.shape)) for n, t in tensors.items()))],
                     aux_files=manifest.aux_files, tp_size=1)
    finalize_manifest(whole)
    return rename_into_place(whole, tmp, out_dir)
