"""Helpers shared by the checkpoint-transfer tests (a uniquely named module: tests/ has no packages)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ckpt_transfer.checksum import checksum_file
from ckpt_transfer.manifest import Manifest, ShardRecord, TensorRecord

REPO = Path(__file__).resolve().parents[2]


def make_iteration(root: Path, run: str, iteration: int, node: str, shard_sizes: list[int], seed: int = 0) -> Manifest:
    """Write safetensors shards (float32 tensors of about the given byte sizes), a config.json and the
    manifest under root/run/<iteration:07d>/, as the publish writer lays them out."""
    from safetensors.numpy import save_file

    d = root / run / f"{iteration:07d}"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + iteration)
    shards = []
    for i, size in enumerate(shard_sizes):
        n = max(size // 4 // 2, 1)
        tensors = {f"layers.{i}.w": rng.standard_normal(n, dtype=np.float32),
                   f"layers.{i}.b": rng.standard_normal((n // 8 or 1, 8), dtype=np.float32)}
        path = d / f"model-{i:05d}.safetensors"
        save_file(tensors, str(path))
        shards.append(ShardRecord(
            file=path.name, node=node, nbytes=path.stat().st_size, checksum=checksum_file(path),
            tensors=tuple(TensorRecord(k, "float32", tuple(v.shape)) for k, v in tensors.items()),
        ))
    (d / "config.json").write_text(json.dumps({"model_type": "tiny", "iteration": iteration}))
    m = Manifest(run=run, iteration=iteration, directory=str(d), shards=shards, aux_files=["config.json"])
    m.save()
    return m


class SourceNode:
    """A publishing node in its own process: serves one manifest until stopped (or killed)."""

    def __init__(self, manifest: Manifest, node: str, root: Path, netns: str | None = None,
                 host: str = "127.0.0.1", config: dict | None = None) -> None:
        cmd = [sys.executable, "-m", "ckpt_transfer.node_agent", "serve", "--node", node, "--root", str(root),
               "--host", host, "--manifest", str(Path(manifest.directory) / "manifest.json"),
               "--config", json.dumps(config or {})]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()  # blocks until the engine serves (or the process died)
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"source node {node} exited with {self.proc.returncode} before serving")
        info = json.loads(line)
        self.address: str = info["address"]
        self.pid: int = info["pid"]

    def kill(self) -> None:
        """SIGKILL the serving process itself and wait until it is gone."""
        if self.proc.poll() is None:
            os.kill(self.pid, 9)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, 9)
                self.proc.wait(timeout=10)


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def merge_published(parts: list) -> tuple:
    """The HFTensor parts a converter published under one name -> (the whole tensor, their shard indices in order):
    one part whole, or shards concatenated along their tp_dim as the engines' directory does."""
    import torch

    parts = sorted(parts, key=lambda p: p.tp_rank)
    whole = parts[0].value() if parts[0].tp_dim is None else torch.cat([p.value() for p in parts], parts[0].tp_dim)
    return whole, [p.tp_rank for p in parts]
