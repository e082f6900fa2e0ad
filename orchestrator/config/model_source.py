"""Where a run's starting weights come from: a local HF directory, a hub id (where a hub is reachable), or
the tiny model built locally from `model.tiny` when no path is given."""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from rollout.tasks import Task
from trainer.tiny_model import TinyModelConfig, build_tiny_model


_HUB_ID = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?")


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id ("name" or "org/name"): absolute, relative with ./ or ../, ~, or
    more than one component."""
    return path.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(path)


def resolve_model_dir(path: str | None, tiny: TinyModelConfig, task: Task, seed: int) -> str:
    if path:
        p = Path(path).expanduser()
        if p.exists():
            return str(p)
        if looks_local(path):
            raise FileNotFoundError(f"model.path {path!r} does not exist")
        return _download(path)
    cache = Path(os.environ.get("TIDE_CACHE", Path.cwd() / ".cache" / "tide"))
    key = hashlib.sha256(repr((tiny.model_dump(), seed, task.corpus())).encode()).hexdigest()[:12]
    return str(build_tiny_model(cache / f"tiny-{task.name}-{key}", task.corpus(), tiny, seed=seed))


def _download(repo_id: str) -> str:
    """A hub id: the same path users take with a real model (fails with the hub's error where none is
    reachable)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
