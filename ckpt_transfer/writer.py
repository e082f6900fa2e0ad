"""Write one trainer rank's HF tensor stream as safetensors shards (normally under /dev/shm) and describe
them as ShardRecords for the manifest."""
from __future__ import annotations

import ctypes
import itertools
import json
import math
import mmap
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .checksum import IncrementalChecksum
from .convert.common import HFTensor
from .manifest import Manifest, ShardRecord, TensorRecord
from .recycle import pool_dir, take_recycled
from .safetensors_format import encode_header

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUX_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


INDEX_FILE = "model.safetensors.index.json"
WRITE_CHUNK = 4 << 20  # tensors are written in row blocks of about this many bytes (one pwrite each)
MIN_SPLIT_BYTES = 32 << 20  # the stream is not cut into files smaller than this to give threads work


# Kept mappings are filled COPY_PIECE bytes at a time, each piece checksummed right after it is copied,
# while the bytes are in L2. glibc's memmove uses non-temporal (streaming) stores for copies larger than
# NON_TEMPORAL_THRESHOLD, which skip reading each destination line before overwriting it; a shard writer
# never reads its output back. glibc's default threshold is 192 MiB here (ld.so --list-diagnostics) and
# it reads the tunable once, at process start (writer_process_env). Measured on this machine, two threads
# into kept mappings, copy plus CRC32C: 8.7 GB/s in 1 MiB streaming pieces, 6.6 GB/s in 4 MiB pieces,
# 6.1 GB/s with plain stores (a 2-thread memcpy ran 9.7 GB/s beside them).
COPY_PIECE = 1 << 20
NON_TEMPORAL_THRESHOLD = COPY_PIECE // 2


def writer_process_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment variables for a process that will write shards (a trainer rank), set when it starts."""
    tunable = f"glibc.cpu.x86_non_temporal_threshold={NON_TEMPORAL_THRESHOLD:#x}"
    existing = environ.get("GLIBC_TUNABLES")
    return {"GLIBC_TUNABLES": f"{existing}:{tunable}" if existing else tunable}


def write_shards(stream: Iterable[HFTensor], out_dir: str | Path, *, node: str, prefix: str,
                 shard_bytes: int, dtype: str = "float32", threads: int = 2) -> list[ShardRecord]:
    """Write the stream as safetensors files of at most `shard_bytes` each, `threads` files at a time.

    tmpfs serializes writes to one file (the inode lock; measured here: two threads into one file 3.5 GB/s,
    into two files 6.0 GB/s), so the bytes are spread over `threads` files of about equal size (more if
    shard_bytes requires), but not into files under MIN_SPLIT_BYTES. Each file is written under a temporary
    name and renamed once complete, so a reader never opens half a shard, and reuses the pages of a
    collected iteration when the run's recycle pool has a file (ckpt_transfer.recycle)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = _DTYPES[dtype]
    items = list(stream)
    sizes = [t.tensor.numel() * target.itemsize for t in items]
    parts = max(1, min(threads, sum(sizes) // MIN_SPLIT_BYTES))
    groups = [[items[i] for i in g] for g in split_in_order(sizes, parts, shard_bytes)]
    pool = pool_dir(out_dir.parent)
    MAPPINGS.prune()

    def write(index: int) -> ShardRecord:
        group = groups[index]
        path = out_dir / f"{prefix}-{index:05d}.safetensors"
        tensors = [(t.name, t.tensor.detach().to("cpu", target)) for t in group]
        shapes = {t.name: t.shape for t in group if t.shape is not None}
        nbytes, checksum = write_safetensors(path, tensors, {"format": "pt"}, recycle_pool=pool, shapes=shapes)
        return ShardRecord(
            file=path.name, node=node, nbytes=nbytes, checksum=checksum,
            tensors=tuple(TensorRecord(t.name, dtype, t.hf_shape, t.tp_rank, t.tp_size, t.tp_dim) for t in group),
        )

    if threads == 1 or len(groups) == 1:
        return [write(i) for i in range(len(groups))]
    with ThreadPoolExecutor(min(threads, len(groups)), thread_name_prefix="shard-writer") as ex:
        return list(ex.map(write, range(len(groups))))


def split_in_order(sizes: list[int], parts: int, cap: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 cut into consecutive groups: about `parts` groups of equal bytes (each item
    goes to the part its midpoint falls in, so the last group is never a sliver), none over `cap` bytes
    unless a single item is."""
    total = sum(sizes)
    parts = max(parts, math.ceil(total / cap)) if total else 1
    groups: list[list[int]] = []
    size = done = part = 0
    for i, n in enumerate(sizes):
        want = min(parts - 1, int((done + n / 2) * parts // total)) if total else 0
        if not groups or (groups[-1] and (want > part or size + n > cap)):
            groups.append([])
            size, part = 0, want
        groups[-1].append(i)
        size += n
        done += n
    return groups


class FileMappings:
    """Writable shared mappings of the shard files this process wrote, kept from one publish to the next.

    A recycled file comes back with its pages, and a mapping of it kept from an earlier publish still has
    its page tables filled in, so writing it is a plain memcpy (9.2 GB/s here, against 4.4 GB/s for
    pwrite into the same tmpfs pages, which walks the page cache page by page under the file's lock).
    A mapping keeps its file's memory alive after the file is deleted, so every publish first drops the
    mappings of deleted files (`prune`)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}  # (dev, inode) -> (own fd, mapping)
        self._lock = threading.Lock()

    def prune(self) -> None:
        with self._lock:
            for key, (fd, m) in list(self._maps.items()):
                if os.fstat(fd).st_nlink == 0:
                    self._close(key)

    def map(self, fd: int, size: int) -> mmap.mmap:
        """A mapping of exactly `size` bytes of the open file `fd` (whose size the caller has set)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            entry = self._maps.get(key)
            if entry is not None and len(entry[1]) == size:
                return entry[1]
            if entry is not None:
                self._close(key)
            # MAP_POPULATE: the page tables are filled in one call, not one fault per page
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            self._maps[key] = (os.dup(fd), m)
            return m

    def _close(self, key: tuple[int, int]) -> None:
        fd, m = self._maps.pop(key)
        m.close()
        os.close(fd)


MAPPINGS = FileMappings()  # per process: a trainer rank keeps its shard mappings across publishes


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str], *,
                      recycle_pool: Path | None = None,
                      shapes: Mapping[str, tuple[int, ...]] | None = None) -> tuple[int, str]:
    """Write CPU tensors (any strides; `shapes` as in safetensors_format.encode_header) as one safetensors file,
    checksumming each piece as it lands; return (bytes, checksum).

    Written by hand rather than with safetensors.torch.save_file because that writer truncates its target,
    so it cannot reuse recycled pages or a kept mapping, and wants contiguous tensors; the files load with
    safetensors, transformers and vLLM like any other (tests/ckpt_transfer/test_writer.py and the publish
    integration tests check that)."""
    header = torch.frombuffer(bytearray(encode_header(tensors, metadata, shapes)), dtype=torch.uint8)
    total = header.numel() + sum(t.numel() * t.element_size() for _, t in tensors)
    partial = path.with_name(path.name + ".partial")
    recycled = recycle_pool is not None and take_recycled(recycle_pool, total, partial)
    if not recycled:
        partial.unlink(missing_ok=True)
    crc = IncrementalChecksum()
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, total)
        # New pages: pwrite fills them without zeroing them first (a mapping would fault in zeroed pages:
        # 1.6 against 1.0 GB/s here). Recycled pages: copy into the kept mapping.
        dst = torch.frombuffer(MAPPINGS.map(fd, total), dtype=torch.uint8) if recycled else None
        offset = 0
        for block in itertools.chain([header], *(_row_blocks(t) for _, t in tensors)):
            n = block.numel() * block.element_size()
            if dst is not None:
                _copy_into(dst, offset, block, crc)
            else:
                data = block.contiguous().reshape(-1).view(torch.uint8).numpy()
                _pwrite_all(fd, memoryview(data), offset)
                crc.update(data)
            offset += n
        del dst
    finally:
        os.close(fd)
    partial.rename(path)
    return total, crc.hexdigest()


def _copy_into(dst: torch.Tensor, offset: int, block: torch.Tensor, crc: IncrementalChecksum) -> None:
    """Copy `block` into the byte tensor `dst` at `offset`, COPY_PIECE bytes at a time, checksumming each
    piece while it is still in cache."""
    size = block.element_size()
    if block.is_contiguous() or offset % size:
        src = block.contiguous().reshape(-1).view(torch.uint8)
        data, n = src.numpy(), src.numel()
        for start in range(0, n, COPY_PIECE):
            k = min(COPY_PIECE, n - start)
            # glibc streams copies above NON_TEMPORAL_THRESHOLD past the cache (writer_process_env); the
            # source lines it read stay cached for the CRC
            ctypes.memmove(dst.data_ptr() + offset + start, src.data_ptr() + start, k)
            crc.update(data[start : start + k])
        return
    # strided views (q/k/v out of the fused QKV): whole rows at a time
    row_bytes = block[0].numel() * size
    rows = max(1, COPY_PIECE // row_bytes)
    for r in range(0, block.shape[0], rows):
        part = block[r : r + rows]
        region = dst[offset + r * row_bytes : offset + r * row_bytes + part.numel() * size]
        region.view(block.dtype).view(part.shape).copy_(part)
        crc.update(region.numpy())


def _row_blocks(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """`t` in consecutive blocks of about WRITE_CHUNK bytes along its first dimension (views)."""
    if t.numel() == 0:
        return
    if t.dim() == 0:
        yield t.reshape(1)
        return
    row_bytes = t[0].numel() * t.element_size()
    step = max(1, WRITE_CHUNK // max(row_bytes, 1))
    for r in range(0, t.shape[0], step):
        yield t[r : r + step]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def copy_aux_files(src_dir: str | Path, out_dir: str | Path) -> list[str]:
    """The source directory's config and tokenizer files, config.json with the fields the engines need to compute
    what transformers computes (convert.engine_config) where it lacks them."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    copied = []
    for name in AUX_FILES:
        if (src_dir / name).exists():
            if name == "config.json":
                write_engine_config(src_dir, out_dir / name)
            else:
                shutil.copyfile(src_dir / name, out_dir / name)
            copied.append(name)
    return copied


def write_engine_config(src_dir: Path, dest: Path) -> None:
    """`src_dir`'s config.json completed by convert.engine_config (its bytes unchanged where nothing is missing),
    written under a temporary name and renamed: every trainer rank writes it, and none reads a half-written one."""
    from transformers import AutoConfig

    from .convert.engine_config import complete_config_json

    raw_text = (src_dir / "config.json").read_text()
    raw = json.loads(raw_text)
    completed = complete_config_json(raw, AutoConfig.from_pretrained(src_dir))
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(raw_text if completed == raw else json.dumps(completed, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, dest)


def rename_into_place(manifest: Manifest, staging: str | Path, out_dir: str | Path) -> Path:
    """Replace `out_dir` by the complete directory `staging` (its manifest already finalized) and record the
    new location in the manifest: a reader of `out_dir` never sees a partial directory."""
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    Path(staging).rename(out_dir)
    manifest.directory = str(out_dir)
    manifest.save()
    return out_dir


def finalize_manifest(manifest: Manifest) -> Path:
    """Write the HF index (when every tensor is whole, the directory then loads with from_pretrained and
    vLLM as is) and, last, the manifest itself: its presence marks the iteration complete."""
    out = Path(manifest.directory)
    # a tensor is published whole once, or as shards along one dimension, each shard index once
    parts = [(t.name, t.tp_rank if t.tp_dim is not None else None) for s in manifest.shards for t in s.tensors]
    whole = {n for n, k in parts if k is None}
    dup = sorted({n for n, k in parts if parts.count((n, k)) > 1 or (k is not None and n in whole)})[:5]
    if dup:
        raise ValueError(f"tensor names published twice: {dup}")
    if manifest.is_whole:
        index = {"metadata": {"total_size": manifest.nbytes},
                 "weight_map": {t.name: s.file for s in manifest.shards for t in s.tensors}}
        (out / INDEX_FILE).write_text(json.dumps(index))
        if INDEX_FILE not in manifest.aux_files:
            manifest.aux_files.append(INDEX_FILE)
    return manifest.save()

