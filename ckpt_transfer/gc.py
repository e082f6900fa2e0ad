"""A node's shared-memory layout (`<root>/<run>/<iteration>/`) and garbage collection of old iterations in it."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from ckpt_transfer.manifest import MANIFEST_FILE
from ckpt_transfer.recycle import SHARD_SUFFIX, recycle_shards


def iteration_dir(shm_root: str | os.PathLike[str], run: str, iteration: int) -> Path:
    """Where a node keeps one iteration of a run: `<shm_root>/<run>/<iteration, 7 digits>/`."""
    return Path(shm_root) / run / f"{iteration:07d}"


def iteration_dirs(run_root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Iteration directories (numeric names) under `run_root`, oldest first."""
    root = Path(run_root)
    if not root.is_dir():
        return []
    out = [(int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(out)


def complete_iterations(run_root: str | os.PathLike[str]) -> list[int]:
    """Iterations whose manifest is present (written last, so the directory is complete)."""
    return [it for it, p in iteration_dirs(run_root) if (p / MANIFEST_FILE).exists()]


def remove_iteration(path: str | os.PathLike[str], recycle_budget: int | None = None) -> None:
    """Remove an iteration directory, manifest first so it never looks complete while half-deleted. With
    `recycle_budget`, its shard files go to the run's recycle pool (bounded to that many bytes) first."""
    p = Path(path)
    (p / MANIFEST_FILE).unlink(missing_ok=True)
    if recycle_budget is not None:
        recycle_shards(p, recycle_budget)
    shutil.rmtree(p, ignore_errors=True)


def gc_iterations(run_root: str | os.PathLike[str], keep_last: int, protect: Iterable[int] = (),
                  recycle: bool = False) -> list[int]:
    """Keep the newest `keep_last` iterations (and those in `protect`, e.g. the one vLLM is serving);
    remove the older ones. Returns the removed iteration numbers. With `recycle`, the removed shard files go
    to the run's recycle pool for the next publish to overwrite (see `recycle`); only for a root that no
    transport serves."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    dirs = iteration_dirs(run_root)
    keep = {it for it, _ in dirs[-keep_last:]} | set(protect)
    # the pool keeps what the next publish needs: about the newest iteration's shard bytes
    budget = sum(f.stat().st_size for f in dirs[-1][1].glob(f"*{SHARD_SUFFIX}")) if recycle and dirs else None
    removed = []
    for it, p in dirs:
        if it not in keep:
            remove_iteration(p, budget)
            removed.append(it)
    return removed


def shm_usage(root: str | os.PathLike[str]) -> int:
    """Bytes held by regular files under `root`."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
