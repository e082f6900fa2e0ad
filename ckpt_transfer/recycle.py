"""Reuse the shared-memory pages of collected iterations for the next publish.

A new tmpfs file gets its pages from the kernel one fault at a time, each zeroed before the writer copies
over it: measured here, writing 512 MiB into a new /dev/shm file ran at 1.9 GB/s, into an existing file of
the same size at 4.7 GB/s. So instead of deleting the shard files of an iteration it collects, the
publishing node's GC moves them into `<run root>/.recycle/`, and the writer renames one of them to its new
shard's name and overwrites it in place. The pool holds at most one iteration's bytes, so a run still peaks
at `keep_last + 1` iterations in shared memory, as it did when files were deleted.

Only the publisher's own root recycles: a file still mapped by a transport (a retired Mooncake buffer in
its unmap grace period) must keep its bytes, so roots served to peers delete as before.
"""
from __future__ import annotations

import os
from pathlib import Path

RECYCLE_DIR = ".recycle"
SHARD_SUFFIX = ".safetensors"


def pool_dir(run_root: str | os.PathLike[str]) -> Path:
    return Path(run_root) / RECYCLE_DIR


def recycle_shards(iteration_path: str | os.PathLike[str], budget_bytes: int) -> None:
    """Move the shard files of a collected iteration into its run's pool, then delete the pool's oldest
    files until it holds at most `budget_bytes`."""
    src = Path(iteration_path)
    pool = pool_dir(src.parent)
    pool.mkdir(exist_ok=True)
    for f in sorted(src.glob(f"*{SHARD_SUFFIX}")):
        f.rename(pool / f"{src.name}-{f.name}")
    files = sorted(pool.iterdir(), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    kept = 0
    for f in files:
        size = f.stat().st_size
        if kept + size <= budget_bytes:
            kept += size
        else:
            f.unlink(missing_ok=True)


def take_recycled(pool: str | os.PathLike[str], nbytes: int, dest: str | os.PathLike[str]) -> bool:
    """Rename a pool file to `dest` (the caller then resizes and overwrites it): the smallest one holding
    at least `nbytes`, else the largest. False when the pool is empty. Safe against several writers taking
    from one pool at once: a rename that loses the race moves on to the next file."""
    pool = Path(pool)
    if not pool.is_dir():
        return False
    sizes = []
    for f in pool.iterdir():
        try:
            sizes.append((f.stat().st_size, f))
        except FileNotFoundError:
            continue
    big_enough = sorted((s, f) for s, f in sizes if s >= nbytes)
    too_small = sorted(((s, f) for s, f in sizes if s < nbytes), reverse=True)
    for _, f in big_enough + too_small:
        try:
            f.rename(dest)
            return True
        except FileNotFoundError:
            continue
    return False
