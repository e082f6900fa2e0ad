"""Write one trainer rank's HF tensor stream as safetensors shards (normally under /dev/shm) and describe
them as ShardRecords for the manifest."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from .checksum import checksum_file
from .convert.common import HFTensor
from .manifest import Manifest, ShardRecord, TensorRecord

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
AUX_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


INDEX_FILE = "model.safetensors.index.json"


def iteration_dir(shm_root: str | Path, run: str, iteration: int) -> Path:
    return Path(shm_root) / run / f"{iteration:07d}"


def write_shards(stream: Iterable[HFTensor], out_dir: str | Path, *, node: str, prefix: str,
                 shard_bytes: int, dtype: str = "float32") -> list[ShardRecord]:
    """Group the stream into files of about `shard_bytes` each. A file is written under a temporary name
    and renamed once complete, so a reader never opens half a shard."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = _DTYPES[dtype]
    records: list[ShardRecord] = []
    pending: list[HFTensor] = []
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        path = out_dir / f"{prefix}-{len(records):05d}.safetensors"
        tensors = {t.name: t.tensor.detach().to(target).contiguous() for t in pending}
        tmp = path.with_name(path.name + ".partial")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.rename(path)
        records.append(ShardRecord(
            file=path.name, node=node, nbytes=path.stat().st_size, checksum=checksum_file(path),
            tensors=tuple(TensorRecord(t.name, dtype, tuple(t.tensor.shape), t.tp_rank, t.tp_size, t.tp_dim)
                          for t in pending),
        ))
        pending, pending_bytes = [], 0

    for t in stream:
        nbytes = t.tensor.numel() * target.itemsize
        if pending and pending_bytes + nbytes > shard_bytes:
            flush()
        pending.append(t)
        pending_bytes += nbytes
    flush()
    return records


def copy_aux_files(src_dir: str | Path, out_dir: str | Path) -> list[str]:
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    copied = []
    for name in AUX_FILES:
        if (src_dir / name).exists():
            shutil.copyfile(src_dir / name, out_dir / name)
            copied.append(name)
    return copied


def finalize_manifest(manifest: Manifest) -> Path:
    """Write the HF index (when every tensor is whole, the directory then loads with from_pretrained and
    vLLM as is) and, last, the manifest itself: its presence marks the iteration complete."""
    out = Path(manifest.directory)
    names = [t.name for s in manifest.shards for t in s.tensors]
    if len(names) != len(set(names)) and manifest.tp_size == 1:
        dup = sorted({n for n in names if names.count(n) > 1})[:5]
        raise ValueError(f"tensor names published twice: {dup}")
    if manifest.tp_size == 1:
        index = {"metadata": {"total_size": manifest.nbytes},
                 "weight_map": {t.name: s.file for s in manifest.shards for t in s.tensors}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
        if INDEX_FILE not in manifest.aux_files:
            manifest.aux_files.append(INDEX_FILE)
    return manifest.save()


def remove_iteration(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def gc_iterations(run_root: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete iterations (and any incomplete older one)."""
    run_root = Path(run_root)
    if not run_root.is_dir():
        return []
    its = sorted((p for p in run_root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    removed = []
    for p in its[:-keep_last] if keep_last > 0 else its:
        remove_iteration(p)
        removed.append(p)
    return removed


def disk_usage(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if os.path.exists(path) else 0
