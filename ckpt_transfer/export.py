"""A published iteration as a standalone Hugging Face directory outside shared memory: whole tensors (TP shards
merged), config, tokenizer and chat template, the safetensors index and the manifest (checksums), loadable by
`transformers` and vLLM. Written under `<out>.partial` and renamed when complete."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from .checksum import verify_shard
from .manifest import Manifest
from .reslice import materialize_whole
from .writer import rename_into_place


def export_hf(manifest: Manifest, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    if not manifest.is_whole:
        return materialize_whole(manifest, out_dir)
    src, tmp = Path(manifest.directory), out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for shard in manifest.shards:
        shutil.copyfile(src / shard.file, tmp / shard.file)
        verify_shard(tmp / shard.file, shard)  # what lands on disk is what the engines verified and served
    for name in manifest.aux_files:
        shutil.copyfile(src / name, tmp / name)
    return rename_into_place(replace(manifest, directory=str(tmp)), tmp, out_dir)
